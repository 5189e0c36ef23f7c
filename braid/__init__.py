"""braid: a tensor-parallel LLM inference engine that overlaps communication with computation."""

from braid.engine.grammar import StructuredOutputs
from braid.engine.llm import LLM
from braid.engine.request import RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutputs"]
