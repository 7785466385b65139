"""Training: the model factory, the LM training loop (one process or torchrun + FSDP2), checkpoints, MQAR."""

from loglinear.train.factory import ARCHS, build_model
from loglinear.train.loop import TrainConfig, train

__all__ = ["ARCHS", "build_model", "TrainConfig", "train"]
