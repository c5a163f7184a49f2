"""Decoder models (Llama-3, GPT-OSS) as library code: prefill (TP + SP) and decode (component DP, attention DP)
graphs, a runner with bucket warmup, HF-layout checkpoint names."""

from modules.models.decoder import DecodeModel, KVCache, PrefillModel
from modules.models.gpt_oss import gpt_oss_mlp, gpt_oss_mlp_mappings
from modules.models.llama import llama_mlp, llama_mlp_mappings
from modules.models.runner import ModelRunner

__all__ = ["DecodeModel", "KVCache", "ModelRunner", "PrefillModel", "gpt_oss_mlp", "gpt_oss_mlp_mappings", "llama_mlp",
           "llama_mlp_mappings"]
