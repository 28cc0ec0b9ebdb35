"""The host side: the wrapper facade and its rooms (requests, target checks, pools, compiled steps, scheduler,
speculation policy, generation arguments, tensor parallelism)."""
