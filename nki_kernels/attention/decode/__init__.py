"""The fused decode-attention kernel, one module per job (imported by ../decode_attention.py, the entry):
config (limits, _Config, validation, LNC=2 splits), planning (tiles, packs, slots, steps: pure), common (constants,
helpers), qkv (RMSNorm, QKV, RoPE, fp8 quantisation), kv_io (cache loads and update), isolation (stale rows
excluded by selection), ragged (per-sequence runtime gates), flash (flash-decoding, online softmax), oproj
(o^T layout and the O-projection)."""
