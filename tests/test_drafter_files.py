"""A drafter directory as a user's disk may hold it: a config whose layer counts disagree, and an acceptance
table that belongs to other weights."""
import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest

import jaxspec
from jaxspec.config import ConfigError
from jaxspec.drafter import read_acceptance, weights_sha256
from test_engine import tiny_target

SHIPPED = Path(jaxspec.__file__).parent / "drafters" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def sha256(f: Path) -> str:
    return hashlib.sha256(f.read_bytes()).hexdigest()


def test_layer_count_disagreeing_with_layer_types(target, tmp_path):
    jaxspec.init_drafter(target, num_layers=1, block_size=8).save(tmp_path / "d")
    f = tmp_path / "d" / "config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "num_hidden_layers": 2}))  # layer_types has 1
    with pytest.raises(ConfigError, match="num_hidden_layers 2 but 1 layer_types"):
        jaxspec.load_drafter(tmp_path / "d", target)


def test_acceptance_table_is_tied_to_the_weights(target, tmp_path, caplog):
    d = jaxspec.init_drafter(target, num_layers=1, block_size=8, seed=1)
    d.acceptance = {2: 1.5, 6: 1.9}
    d.save(tmp_path / "d")
    table = tmp_path / "d" / "acceptance.json"
    recorded = json.loads(table.read_text())["weights_sha256"]
    assert recorded == sha256(tmp_path / "d" / "model.safetensors") == weights_sha256(tmp_path / "d")
    assert jaxspec.load_drafter(tmp_path / "d", target).acceptance == {2: 1.5, 6: 1.9}

    # other weights under the same table (a retrained drafter copied over): the table is ignored, with a warning
    jaxspec.init_drafter(target, num_layers=1, block_size=8, seed=2).save(tmp_path / "other")
    shutil.copy(tmp_path / "other" / "model.safetensors", tmp_path / "d" / "model.safetensors")
    with caplog.at_level(logging.WARNING, "jaxspec.drafter"):
        assert jaxspec.load_drafter(tmp_path / "d", target).acceptance is None
    assert str(table) in caplog.text and "--save-acceptance" in caplog.text

    # a table written before the field: still used
    table.write_text(json.dumps({"acceptance_length": {"2": 1.5, "6": 1.9}}))
    assert jaxspec.load_drafter(tmp_path / "d", target).acceptance == {2: 1.5, 6: 1.9}


def test_shipped_table_matches_its_weights():
    recorded = json.loads((SHIPPED / "acceptance.json").read_text())["weights_sha256"]
    assert recorded == sha256(SHIPPED / "model.safetensors")
    table = read_acceptance(SHIPPED)
    assert table and all(1 <= al <= 1 + b for b, al in table.items())
