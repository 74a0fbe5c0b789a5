"""Tensor parallelism over torch.distributed (docs/tensor-parallelism.md): the process group and
its collectives (`parallel_state`), how each weight is sliced (`sharding`), the worker process
loop (`worker`), and the engine's side that spawns the workers and sends them each step
(`executor`)."""
