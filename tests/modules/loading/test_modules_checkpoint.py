"""SafetensorsCheckpoint on real .safetensors files: every rank's sharded load reassembles the full tensors,
only the rank's slices are read, and bad checkpoints raise errors naming the tensor."""

import json

import pytest
import torch
from safetensors.torch import save_file

from modules.layers import ColumnParallelLinear, QKVParallelLinear, RMSNorm, RowParallelLinear, VocabDimShardedEmbedding
from modules.loading import SafetensorsCheckpoint
from modules.parallel.coordinator import StaticGroup

V, H, INTER, HEADS, KV, HD = 30, 8, 12, 4, 2, 2


class Block(torch.nn.Module):
    def __init__(self, group):
        super().__init__()
        self.embed = VocabDimShardedEmbedding(V, H, group)
        self.up = ColumnParallelLinear(H, INTER, group, bias=True)
        self.down = RowParallelLinear(INTER, H, group, bias=True)
        self.qkv = QKVParallelLinear(H, HEADS, KV, HD, group)
        self.norm = RMSNorm(H, padded_size=H + 4)


def full_tensors():
    g = torch.Generator().manual_seed(1)
    return {
        "model.embed_tokens.weight": torch.randn(V, H, generator=g),
        "model.up.weight": torch.randn(INTER, H, generator=g), "model.up.bias": torch.randn(INTER, generator=g),
        "model.down.weight": torch.randn(H, INTER, generator=g), "model.down.bias": torch.randn(H, generator=g),
        "model.q.weight": torch.randn(HEADS * HD, H, generator=g),
        "model.k.weight": torch.randn(KV * HD, H, generator=g),
        "model.v.weight": torch.randn(KV * HD, H, generator=g),
        "model.norm.weight": torch.randn(H, generator=g),
    }


MAPPINGS = {
    "embed.weight": "model.embed_tokens.weight", "up.weight": "model.up.weight", "up.bias": "model.up.bias",
    "down.weight": "model.down.weight", "down.bias": "model.down.bias",
    "qkv.weight": {"q": "model.q.weight", "k": "model.k.weight", "v": "model.v.weight"},
    "norm.weight": "model.norm.weight",
}


@pytest.fixture
def ckpt_dir(tmp_path):
    full = full_tensors()
    keys = sorted(full)
    # Two shards plus an index, like a Hugging Face checkpoint.
    save_file({k: full[k] for k in keys[:4]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: full[k] for k in keys[4:]}, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {k: ("model-00001-of-00002.safetensors" if i < 4 else "model-00002-of-00002.safetensors")
                  for i, k in enumerate(keys)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_rank_reproduces_full_tensors(ckpt_dir, tp):
    full = full_tensors()
    ckpt = SafetensorsCheckpoint(ckpt_dir)
    assert ckpt.keys() == sorted(full)
    shards = []
    for r in range(tp):
        model = Block(StaticGroup(tp, r))
        state = ckpt.load_sharded_pipelined(rank=r, world_size=tp, model=model, mappings=MAPPINGS)
        assert torch.equal(state["up.weight"], model.up.weight)  # copied into the parameters
        shards.append(state)
    emb = torch.cat([s["embed.weight"] for s in shards])
    assert torch.equal(emb[:V], full["model.embed_tokens.weight"]) and not emb[V:].any()
    assert torch.equal(torch.cat([s["up.weight"] for s in shards]), full["model.up.weight"])
    assert torch.equal(torch.cat([s["up.bias"] for s in shards]), full["model.up.bias"])
    assert torch.equal(torch.cat([s["down.weight"] for s in shards], dim=1), full["model.down.weight"])
    for s in shards:
        assert torch.equal(s["down.bias"], full["model.down.bias"])
        assert torch.equal(s["norm.weight"][:H], full["model.norm.weight"]) and not s["norm.weight"][H:].any()
    q_size = HEADS * HD // tp
    assert torch.equal(torch.cat([s["qkv.weight"][:q_size] for s in shards]), full["model.q.weight"])


def test_reads_only_rank_slices(ckpt_dir):
    full = full_tensors()
    ckpt = SafetensorsCheckpoint(ckpt_dir)
    ckpt.load_sharded(rank=1, world_size=4, model=Block(StaticGroup(4, 1)), mappings=MAPPINGS)
    for key in ("model.up.weight", "model.down.weight", "model.q.weight"):
        assert ckpt.bytes_read[key] == full[key].numel() * 4 // 4, key
    # Embedding: 30 rows over 4 ranks → 8 rows per rank; rank 1 reads rows 8..15.
    assert ckpt.bytes_read["model.embed_tokens.weight"] == 8 * H * 4
    assert ckpt.bytes_read["model.norm.weight"] == H * 4  # replicated: read whole


def test_single_file_and_default_names(tmp_path):
    model = torch.nn.Linear(3, 2)
    save_file({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, tmp_path / "m.safetensors")
    ckpt = SafetensorsCheckpoint(tmp_path / "m.safetensors")
    ckpt.load_sharded(0, 1, model)
    assert torch.equal(model.weight, torch.ones(2, 3)) and ckpt.shape("weight") == (2, 3)
    assert torch.equal(ckpt.load_full("bias"), torch.zeros(2))


def test_missing_tensor_named(ckpt_dir):
    ckpt = SafetensorsCheckpoint(ckpt_dir)
    bad = dict(MAPPINGS, **{"up.weight": "model.nope.weight"})
    with pytest.raises(KeyError, match=r"no tensor 'model.nope.weight' \(needed by parameter 'up.weight'\)"):
        ckpt.load_sharded(0, 2, Block(StaticGroup(2, 0)), mappings=bad)
    with pytest.warns(UserWarning, match=r"1 parameter\(s\) not loaded.*up.weight \(no 'model.nope.weight'\)"):
        state = ckpt.load_sharded(0, 2, Block(StaticGroup(2, 0)), mappings=bad, strict=False)
    assert "up.weight" not in state and "down.weight" in state  # skipped, the rest loaded
    with pytest.raises(KeyError, match=r"does not have: \['nope'\]"):
        ckpt.load_sharded(0, 2, Block(StaticGroup(2, 0)), mappings={"nope": "x"})


def test_shape_mismatch_named(tmp_path):
    full = full_tensors()
    full["model.up.weight"] = torch.zeros(INTER + 2, H)  # wrong out_features in the file
    save_file(full, tmp_path / "m.safetensors")
    ckpt = SafetensorsCheckpoint(tmp_path)
    with pytest.raises(ValueError, match=r"parameter 'up.weight' from 'model.up.weight': dim 0 has 14 rows"):
        ckpt.load_sharded(0, 2, Block(StaticGroup(2, 0)), mappings=MAPPINGS)
    full = full_tensors()
    full["model.down.bias"] = torch.zeros(H + 1)  # replicated: shape checked against the parameter
    save_file(full, tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match=r"parameter 'down.bias': loaded shape \(9,\) .* != parameter shape \(8,\)"):
        SafetensorsCheckpoint(tmp_path).load_sharded(0, 2, Block(StaticGroup(2, 0)), mappings=MAPPINGS)


def test_bad_paths_and_rank(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        SafetensorsCheckpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"no .safetensors files"):
        SafetensorsCheckpoint(tmp_path)
    save_file({"a": torch.zeros(1)}, tmp_path / "x.safetensors")
    save_file({"a": torch.zeros(1)}, tmp_path / "y.safetensors")
    with pytest.raises(ValueError, match=r"tensor 'a' appears in both x.safetensors and y.safetensors"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "y.safetensors").unlink()
    with pytest.raises(ValueError, match=r"rank=2 out of range for world_size=2"):
        SafetensorsCheckpoint(tmp_path).load_sharded(2, 2, torch.nn.Linear(1, 1))
