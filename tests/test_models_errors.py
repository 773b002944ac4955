"""Bad model files must fail loudly, naming the file and the tensor or key at fault."""
import json
import shutil

import numpy as np
import pytest

from vkdsl.models import (LlamaConfig, ModelFileError, Tokenizer, load_checkpoint, load_gguf,
                          load_hf, load_model_files)
from fixtures.synthetic import (TINY_CONFIG, build_tiny, random_hf_weights,
                                    tiny_bpe, write_gguf)
from vkdsl.models.safetensors_loader import hf_name_to_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def parts():
    """(gguf-named F32 weights, cfg, vocab) to write deliberately broken files from."""
    cfg = dict(TINY_CONFIG)
    w = {hf_name_to_gguf(k): v for k, v in random_hf_weights(cfg, seed=4).items()}
    return w, cfg, tiny_bpe()


def test_good_files_load(tiny):
    assert load_checkpoint(tiny.gguf_path).format == "gguf"
    assert load_checkpoint(tiny.hf_dir).format == "safetensors"


def test_unsupported_architecture(tmp_path, parts):
    w, cfg, vocab = parts
    path = write_gguf(tmp_path / "gemma.gguf", w, cfg, vocab, arch="gemma2")
    with pytest.raises(ModelFileError, match=r"gemma\.gguf.*general\.architecture is 'gemma2'; supported"):
        load_gguf(path)


def test_qwen2_without_its_biases_is_refused(tmp_path, parts):
    w, cfg, vocab = parts            # plain Llama tensors under a qwen2 header: the biases are missing
    path = write_gguf(tmp_path / "qwen.gguf", w, cfg, vocab, arch="qwen2")
    with pytest.raises(ModelFileError, match=r"qwen\.gguf: missing tensor 'blk\.0\.attn_q\.bias'"):
        load_gguf(path)


def test_missing_tensor(tmp_path, parts):
    w, cfg, vocab = parts
    w = {k: v for k, v in w.items() if k != "blk.1.ffn_up.weight"}
    path = write_gguf(tmp_path / "missing.gguf", w, cfg, vocab, types={})
    with pytest.raises(ModelFileError, match=r"missing\.gguf.*missing tensor 'blk\.1\.ffn_up"):
        load_gguf(path)


def test_unexpected_tensor(tmp_path, parts):
    w, cfg, vocab = parts                  # a bias on q (Qwen2 has them; plain Llama does not)
    w = dict(w, **{"blk.0.attn_q.bias": np.ones(cfg["n_heads"] * cfg["head_dim"], np.float32)})
    path = write_gguf(tmp_path / "extra.gguf", w, cfg, vocab, types={})
    with pytest.raises(ModelFileError, match=r"extra\.gguf.*'blk\.0\.attn_q\.bias'"):
        load_gguf(path)


def test_rope_freqs_of_the_wrong_length(tmp_path, parts):
    w, cfg, vocab = parts
    w = dict(w, **{"rope_freqs.weight": np.ones(cfg["head_dim"] // 2 + 1, np.float32)})
    path = write_gguf(tmp_path / "freqs.gguf", w, cfg, vocab, types={})
    with pytest.raises(ModelFileError, match=rf"freqs\.gguf: rope_freqs\.weight must be {cfg['head_dim'] // 2} F32"):
        load_gguf(path)


def test_shape_inconsistent_with_config(tmp_path, parts):
    w, cfg, vocab = parts
    path = write_gguf(tmp_path / "ffn.gguf", w, dict(cfg, ffn_dim=128), vocab, types={})
    with pytest.raises(ModelFileError,
                       match=r"ffn\.gguf.*'blk\.0\.ffn_gate\.weight' has shape \(96, 64\).*"
                             r"\(128, 64\)"):
        load_gguf(path)


def test_unsupported_tensor_type(tmp_path, parts):
    w, cfg, vocab = parts
    path = write_gguf(tmp_path / "q5.gguf", w, cfg, vocab, types={"blk.0.ffn_up.weight": "Q5_0"})
    with pytest.raises(ModelFileError, match=r"q5\.gguf.*'blk\.0\.ffn_up\.weight' has type Q5_0"):
        load_gguf(path)


@pytest.mark.parametrize("keep, detail", [
    (0.5, r"\(tensor 'blk\.\d\.\w+\.weight' \(\w+ \[\d+, \d+\]\) needs bytes \[\d+, \d+\)"),
    (0.999, r"\(tensor 'blk\.1\.ffn_down\.weight' \(F32 \[64, 96\]\) needs bytes"),
    (0.01, r"\(expected the GGUF header")])   # cut inside the metadata: no tensor table
def test_truncated_gguf(tmp_path, tiny, keep, detail):
    path = tmp_path / "cut.gguf"
    data = tiny.gguf_path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ModelFileError, match=r"cut\.gguf: not a readable GGUF file, truncated "
                                             r"or corrupt " + detail):
        load_gguf(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(ModelFileError, match=r"junk\.gguf: not a readable GGUF file.*magic"):
        load_gguf(path)
    with pytest.raises(ModelFileError, match=r"nothere\.gguf: no such"):
        load_gguf(tmp_path / "nothere.gguf")


def test_gguf_vocab_mismatch(tmp_path, parts):
    w, cfg, vocab = parts             # more tokens than embedding rows (fewer is a padded table: fine)
    path = write_gguf(tmp_path / "vocab.gguf", w, dict(cfg, vocab_size=299), vocab, types={})
    with pytest.raises(ModelFileError, match=r"vocab\.gguf.*300 tokens.*vocabulary is 299"):
        Tokenizer.from_gguf(path)


def test_gguf_unknown_pretokenizer(tmp_path, parts):
    w, cfg, vocab = parts
    path = write_gguf(tmp_path / "pre.gguf", w, cfg, vocab, types={}, pre="mystery-pre")
    with pytest.raises(ModelFileError, match=r"pre\.gguf.*tokenizer\.ggml\.pre.*'mystery-pre'"):
        Tokenizer.from_gguf(path)


def _hf_copy(tiny, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(tiny.hf_dir, folder)
    return folder


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_hf_vocab_mismatch(tmp_path, tiny):
    folder = _hf_copy(tiny, tmp_path)
    _edit_json(folder / "config.json", vocab_size=290)
    with pytest.raises(ModelFileError, match=r"tokenizer\.json.*300 tokens.*vocabulary is 290"):
        Tokenizer.from_hf(folder)


def test_hf_wrong_model_type(tmp_path, tiny):
    folder = _hf_copy(tiny, tmp_path)
    _edit_json(folder / "config.json", model_type="gemma")
    with pytest.raises(ModelFileError, match=r"config\.json.*model_type is 'gemma'; supported: 'llama', 'mistral'"):
        load_hf(folder)


def test_hf_truncated_safetensors(tmp_path, tiny):
    folder = _hf_copy(tiny, tmp_path)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    with pytest.raises(ModelFileError, match=r"model\.safetensors: truncated or corrupt"):
        load_hf(folder)


def test_hf_missing_tensor(tmp_path, tiny):
    from fixtures.synthetic import write_safetensors
    folder = _hf_copy(tiny, tmp_path)
    w = {k: v for k, v in tiny.hf_weights.items() if k != "model.norm.weight"}
    write_safetensors(folder / "model.safetensors", w, {})
    with pytest.raises(ModelFileError, match=r"hf: missing tensor 'output_norm\.weight'"):
        load_hf(folder)


def test_config_validation_names_the_keys():
    good = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                vocab_size=300)
    LlamaConfig(**good)
    with pytest.raises(ValueError, match=r"n_heads \(4\) must be a multiple of n_kv_heads \(3\)"):
        LlamaConfig(**dict(good, n_kv_heads=3))
    with pytest.raises(ValueError, match=r"head_dim must be even"):
        LlamaConfig(**dict(good, head_dim=15))
    with pytest.raises(ValueError, match=r"ffn_dim must be a positive int"):
        LlamaConfig(**dict(good, ffn_dim=0))
    with pytest.raises(ValueError, match=r"eos_id = 300 is outside"):
        LlamaConfig(**dict(good, eos_id=300))


def test_chat_template_is_sandboxed(tiny):
    tok = Tokenizer.from_gguf(tiny.gguf_path)
    tok.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ModelFileError, match="SecurityError: access to attribute '__class__'"):   # the sandbox held
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(ModelFileError, match="no system role"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_hf_rope_parameters_of_transformers_5(tmp_path, tiny):
    # transformers 5.x keeps RoPE settings under rope_parameters: read it, never default silently
    folder = _hf_copy(tiny, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    theta = cfg.pop("rope_theta", 10000.0)
    cfg["rope_parameters"] = {"rope_theta": 100000.0, "rope_type": "default"}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_hf(folder).config.rope_base == 100000.0 != theta
    cfg["rope_parameters"] = {"rope_theta": 100000.0, "rope_type": "yarn", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match=r"rope_parameters\.rope_type = 'yarn'"):
        load_hf(folder)
    cfg["rope_parameters"] = {"rope_theta": 100000.0, "partial_rotary_factor": 0.5}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match=r"partial_rotary_factor"):
        load_hf(folder)


def test_a_bare_safetensors_file_is_not_called_a_bad_gguf(tiny):
    with pytest.raises(ModelFileError, match=r"model\.safetensors: a bare \.safetensors file .* folder"):
        load_model_files(tiny.hf_dir / "model.safetensors")


def test_byte_flipped_gguf_metadata_is_a_model_file_error(tmp_path, tiny):
    # flips in the header, key/values and tensor table: a ModelFileError naming the file, or a model
    raw = tiny.gguf_path.read_bytes()
    rng = np.random.default_rng(0)
    for i in range(300):
        b = bytearray(raw)
        for pos in rng.integers(0, 4000, size=rng.integers(1, 4)):
            b[int(pos)] = int(rng.integers(0, 256))
        path = tmp_path / f"f{i % 4}.gguf"
        path.write_bytes(bytes(b))
        try:
            load_model_files(path)
        except ModelFileError as e:
            assert str(path) in str(e)
