"""The environment switches (kernels/env.py) for the app: app/ reaches nothing below the engine,
so it imports them from here. The engine itself imports kernels.env like the layers below it."""
from kernels.env import VARIABLES, ConfigError, Env, env, reload

__all__ = ["VARIABLES", "ConfigError", "Env", "env", "reload"]
