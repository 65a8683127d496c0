"""torch.nn layers built on fusedops.ops: the single-process mixers of a Nemotron-H / Nemotron 3
model (``modules``) and those that take a process group, for expert and context parallelism
(``parallel``, subclasses of the former)."""

from .modules import (EngramGate, GatedRMSNorm, GQAAttention, KVState, Mamba2Mixer, Mamba2State,
                      ReLU2MoE)
from .parallel import ContextParallelGQAAttention, ContextParallelMamba2Mixer, ExpertParallelReLU2MoE

__all__ = ["ContextParallelGQAAttention", "ContextParallelMamba2Mixer", "EngramGate",
           "ExpertParallelReLU2MoE", "GQAAttention", "GatedRMSNorm", "KVState", "Mamba2Mixer",
           "Mamba2State", "ReLU2MoE"]
