"""Environments: the env API (`env.py`), trajectories, every task run as an env, message and tool
envs, and the built-in multi-turn envs. `task.options.env = "module:function"` names a dataset of them."""
