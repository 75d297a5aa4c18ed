"""One Adam update on the benchmark MLP's parameters: torch vs Keras.

    OMP_NUM_THREADS=1 python benchmarks/bench_optimizer.py

Part of Keras's per-step overhead over plain torch (single process, no
distribution): the same 4 x (1024 x 1024) + 4 x 1024 fp32 tensors.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import torch  # noqa: E402


def _median_ms(fn, steps=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main():
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shapes = [(1024, 1024)] * 4 + [(1024,)] * 4
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    torch_adam = torch.optim.Adam(params, lr=1e-4, foreach=True)
    variables = [keras.Variable(p.detach().clone()) for p in params]
    keras_adam = keras.optimizers.Adam(1e-4)
    keras_adam.build(variables)
    grads = [p.grad for p in params]

    def keras_step():
        with torch.no_grad():
            keras_adam.apply(grads, variables)

    print(f"torch Adam step: {_median_ms(torch_adam.step):.1f} ms")
    print(f"Keras Adam apply: {_median_ms(keras_step):.1f} ms")


if __name__ == "__main__":
    main()
