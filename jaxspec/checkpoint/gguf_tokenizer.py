"""A GGUF's tokenizer, built without torch.

`transformers.AutoTokenizer.from_pretrained(dir, gguf_file=...)` reads the file's metadata with a reader that
imports torch. Everything else on that path does not need it: the `tokenizers` backend is built from a dict
of the file's tokenizer fields (`convert_gguf_tokenizer`), and the transformers tokenizer around it takes the
special tokens, the BOS/EOS flags and the chat template as keyword arguments. Here gguf's own reader supplies
those fields, and the rest follows transformers' path: the same converter, the same tokenizer class for the
architecture, the same keyword arguments (tests/test_gguf_tokenizer.py compares the two).
"""
from __future__ import annotations

from pathlib import Path

# the special tokens transformers sets from the file, and the metadata key (under tokenizer.ggml.) of each id
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}
# tokenizer config keyword -> metadata key
_CONFIG_KEYS = {"chat_template": "tokenizer.chat_template", "add_bos_token": "tokenizer.ggml.add_bos_token",
                "add_eos_token": "tokenizer.ggml.add_eos_token"}


def _converter():
    """transformers' GGUF tokenizer converter and its table of `tokenizer.*` keys (the module moved in 5.x)."""
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    return convert_gguf_tokenizer, GGUF_TOKENIZER_MAPPING["tokenizer"]


def _tokenizer_class(arch: str):
    """The class AutoTokenizer picks for the model type the architecture names (TokenizersBackend if none)."""
    import transformers
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    name = TOKENIZER_MAPPING_NAMES.get(arch) or TOKENIZER_MAPPING_NAMES.get(f"{arch}_text")
    if isinstance(name, (tuple, list)):  # (slow, fast) in older releases
        name = name[-1] or name[0]
    cls = tokenizer_class_from_name(name) if name else None
    return cls or transformers.PreTrainedTokenizerFast


def read_tokenizer_fields(path: Path) -> tuple[str, dict, dict]:
    """(architecture, the converter's tokenizer dict, the tokenizer's keyword arguments) from the file's
    metadata, read by gguf: the arguments are the special tokens (their strings; None for an id the file
    does not give), add_bos_token / add_eos_token and the chat template, as transformers derives them."""
    import gguf

    _, keys = _converter()
    fields = gguf.GGUFReader(str(path)).fields

    def value(key):
        f = fields.get(key)
        return None if f is None else f.contents()

    arch = value("general.architecture")
    tokens = value("tokenizer.ggml.tokens")
    if arch is None or tokens is None:
        raise ValueError(f"{path} holds no {'architecture' if arch is None else 'vocabulary'}")
    found = {name: value(f"tokenizer.{key}") for key, name in keys.items()}
    tokenizer = {name: v for name, v in found.items() if v is not None}
    config = {name: value(key) for name, key in _CONFIG_KEYS.items()}
    config = {name: v for name, v in config.items() if v is not None}
    if tokenizer.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary by default
        config.setdefault("add_bos_token", True)
    elif tokenizer.get("tokenizer_type") == "gemma4":  # its chat template writes <bos> itself
        config["add_bos_token"] = False
    for name, key in _SPECIAL_IDS.items():
        i = value(f"tokenizer.ggml.{key}")
        config[name] = tokens[i] if i is not None else None
    return arch, tokenizer, config


def gguf_tokenizer(path: Path):
    """The transformers tokenizer of a GGUF file, built as `AutoTokenizer.from_pretrained(gguf_file=)` builds
    it but from gguf's reading of the metadata, so torch need not be importable."""
    convert, _ = _converter()
    arch, fields, config = read_tokenizer_fields(Path(path))
    backend, extra = convert(arch, fields)
    return _tokenizer_class(arch)(tokenizer_object=backend, **{**config, **extra})
