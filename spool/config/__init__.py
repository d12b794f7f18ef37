"""The engine's settings: their definitions, the units they are written in, the engine config, fairness."""
