"""`trillora serve`: the OpenAI and Tinker routes (one HTTP layer) over one resident base and its
adapters, on one process or a torchrun layout."""
