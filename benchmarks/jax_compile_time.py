"""How long the first (compiling) call of a jitted JAX train step takes.

Usage: `python benchmarks/jax_compile_time.py [--rounds N] [--widths 1024,1024,...]`.

Three rows, on one float16-compute MLP (float32 parameters; by default
1024-1024-1024-1024-256, 3,411,200 parameters) and one batch:

- `optax`: plain `optax.adam`, no loss scaling;
- `lossscale.optax`: `lossscale.optax.dynamic_loss_scale(optax.adam)`;
- `jmp`: jmp's `DynamicLossScale` around `optax.adam`, the skip written with
  `jmp.all_finite` and `jmp.select_tree`.

Each measurement runs in a fresh Python process with JAX's persistent
compilation cache off, so nothing compiled before is reused. In the process
JAX is started first (a trivial jitted call) and the optimizer state is
built; then the first call of the jitted step is timed, up to its result
being ready: tracing, lowering, XLA's compilation and one execution. The
second call is timed as well (execution alone), and then, on a new step
function (so that no trace is reused), the phases apart: `jit(step).lower`
(tracing and lowering) and `.compile()` (XLA). The rows alternate from
round to round (A B C, then C B A). The table gives each row's median over
the rounds, and the median over the rounds of the first call's ratio to
`optax` in the same round, in wall-clock time and in the process's CPU time
(all threads; less disturbed by other processes on a shared machine).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROWS = ("optax", "lossscale.optax", "jmp")


def child(row, widths, batch):
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    import jax.numpy as jnp
    import jmp
    import optax

    import lossscale.optax as lso

    jax.jit(lambda x: x + 1)(jnp.ones(())).block_until_ready()  # JAX itself started
    keys = jax.random.split(jax.random.PRNGKey(0), len(widths) + 1)
    params = [
        {"w": jax.random.normal(k, (a, b)) / a**0.5, "b": jnp.zeros(b)}
        for k, a, b in zip(keys[1:], widths[:-1], widths[1:])
    ]
    x = jax.random.normal(keys[0], (batch, widths[0]))
    y = jnp.zeros((batch, widths[-1]))

    def loss_fn(params):
        h = x.astype(jnp.float16)
        for i, layer in enumerate(params):
            h = h @ layer["w"].astype(jnp.float16) + layer["b"].astype(jnp.float16)
            h = jax.nn.relu(h) if i < len(params) - 1 else h
        return jnp.mean((h.astype(jnp.float32) - y) ** 2)

    def build():  # a new step function each call: nothing of an earlier trace is reused
        if row == "optax":
            tx = optax.adam(1e-3)

            def step(params, state):
                grads = jax.grad(loss_fn)(params)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            return tx.init(params), step
        if row == "lossscale.optax":
            tx = lso.dynamic_loss_scale(optax.adam(1e-3))

            def step(params, state):
                grads = jax.grad(lambda p: lso.scale_loss(loss_fn(p), state))(params)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            return tx.init(params), step
        tx = optax.adam(1e-3)

        def step(params, state):
            # The scale's fields, not the object: `jit(...).lower` cannot take a
            # `jmp.DynamicLossScale` argument (its unflattening inspects the leaves).
            opt_state, (scale, counter) = state
            loss_scale = jmp.DynamicLossScale(scale, counter)
            grads = jax.grad(lambda p: loss_scale.scale(loss_fn(p)))(params)
            grads = loss_scale.unscale(grads)
            finite = jmp.all_finite(grads)
            updates, new_opt_state = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            params, opt_state = jmp.select_tree(
                finite, (new_params, new_opt_state), (params, opt_state)
            )
            loss_scale = loss_scale.adjust(finite)
            return params, (opt_state, (loss_scale.loss_scale, loss_scale.counter))

        return (tx.init(params), (jnp.float32(2.0**15), jnp.int32(0))), step

    state, step = jax.block_until_ready(build())
    step = jax.jit(step)
    times = []
    for _ in range(2):  # the first call, then the second
        start, cpu = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(step(params, state))
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    # The phases, on a new step function: tracing and lowering, then XLA's compilation.
    state, step = jax.block_until_ready(build())
    start = time.perf_counter()
    lowered = jax.jit(step).lower(params, state)
    traced = time.perf_counter() - start
    lowered.compile()
    compiled = time.perf_counter() - start - traced
    count = sum(p["w"].size + p["b"].size for p in out[0])
    result = {"first": times[0][0], "first_cpu": times[0][1], "second": times[1][0]}
    result.update(trace=traced, compile=compiled)
    print(json.dumps({"row": row, "parameters": count, **result}))


def measure(row, widths, batch):
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false", "JAX_PLATFORMS": "cpu"}
    args = ["--child", row, "--widths", ",".join(map(str, widths)), "--batch", str(batch)]
    proc = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{row} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--widths", default="1024,1024,1024,1024,256")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--child", choices=ROWS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    if args.child:
        return child(args.child, widths, args.batch)
    runs = {row: [] for row in ROWS}
    for r in range(args.rounds):
        for row in ROWS if r % 2 == 0 else ROWS[::-1]:
            runs[row].append(measure(row, widths, args.batch))
    parameters = runs[ROWS[0]][0]["parameters"]
    print(f"MLP {args.widths}, {parameters:,} parameters, batch {args.batch}, {args.rounds} rounds")
    print(
        "| row | first call (s) | x optax | first call, CPU time (s) | x optax "
        "| trace + lower (s) | XLA compile (s) | second call (ms) | x optax per round |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for row, ms in runs.items():
        # Ratios to `optax` in the same round, then their median: the machine's
        # drift from round to round cancels out.
        ratios = [m["first"] / b["first"] for m, b in zip(ms, runs["optax"])]
        cpu_ratios = [m["first_cpu"] / b["first_cpu"] for m, b in zip(ms, runs["optax"])]
        first, cpu, trace, compiled, second = (
            statistics.median(m[k] for m in ms)
            for k in ("first", "first_cpu", "trace", "compile", "second")
        )
        print(
            f"| {row} | {first:.3f} | {statistics.median(ratios):.2f} | {cpu:.3f} "
            f"| {statistics.median(cpu_ratios):.2f} | {trace:.3f} | {compiled:.3f} "
            f"| {second * 1e3:.1f} | {' / '.join(f'{r:.2f}' for r in ratios)} |"
        )


if __name__ == "__main__":
    main()
