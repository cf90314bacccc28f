"""Hydra configs shipped with guardtrain (``pkg://guardtrain.conf``); see ``guard/``."""
