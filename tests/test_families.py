"""The model families (jaxllm.families): every family module registered, each family's preset what its Hugging Face
tables need, its sizes valid models, and every checkpoint format (jaxllm.formats) named in docs/architecture.md."""

import importlib
import pkgutil
from pathlib import Path

import pytest

from jaxllm import config, families, formats
from jaxllm.families import registry
from jaxllm.formats import hf
from jaxllm.resolve import resolve_model

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"tables", "registry"}  # the families' types and their list: not families


def _family_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(families.__path__) if m.name not in ENGINE)


def test_every_family_module_is_registered():
    """A module of jaxllm/families declares its FAMILY and the registry lists it (else the formats never see it)."""
    names = _family_modules()
    assert len(names) >= 5
    for name in names:
        module = importlib.import_module(f"jaxllm.families.{name}")
        assert module.FAMILY.name == name and module.FAMILY in registry.FAMILIES, name
    assert sorted(f.name for f in registry.FAMILIES) == names


def test_every_format_is_listed_in_the_architecture_document():
    """docs/architecture.md's tree names each module of jaxllm/formats (a new format's recipe starts there)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    entry = text[text.index("  formats/"):text.index("  api.py")]
    for m in pkgutil.iter_modules(formats.__path__):
        assert m.name in entry, m.name


def _model(**keys) -> config.Model:
    m = config.get_config().model
    m.update(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, **keys)
    return resolve_model(m, seq_length=32)


@pytest.mark.parametrize("family", registry.FAMILIES, ids=lambda f: f.name)
def test_preset_is_what_its_tables_need(family):
    """Each table of a family needs the family's preset; a small model of the preset and of the table's other
    needs exports as that very table."""
    for arch in family.architectures:
        assert {k: arch.needs[k] for k in family.preset} == family.preset, arch.model_type
        extra = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32} if "num_experts" not in arch.needs \
            else {}
        if arch.needs.get("multi_latent_attention"):
            extra.update(kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
                         moe_shared_expert_intermediate_size=32, moe_layer_freq="[0,1]")
        keys = {**extra, **arch.needs, "num_kv_heads": 0 if arch.needs.get("multi_latent_attention") else 4}
        if "sliding_window" not in arch.needs:
            keys["sliding_window"] = 8
        assert hf.hf_architecture(_model(**keys)) is arch


def test_sizes_are_valid_models():
    """Every published size resolves (its keys exist and fit together) and no two families name the same one."""
    keys = [k for f in registry.FAMILIES for k in f.sizes]
    assert len(keys) == len(set(keys)) == len(registry.SIZES)
    for key, size in registry.SIZES.items():
        m = config.get_config().model
        m.update(**size)
        assert resolve_model(m, seq_length=2048).num_layers == size["num_layers"], key
