"""Planning a cluster, apart from the runtime engine it plans for (`trillora.parallel`): the cost
of a layout (`cost`: memory, traffic, time per step), the GPUs it is priced on (`clusters`), the
search over layouts (`planner`: `trillora plan`, `parallel = "auto"`, the Tinker service's
layouts) and the measured peak its memory model is checked against (`memory_probe`)."""
