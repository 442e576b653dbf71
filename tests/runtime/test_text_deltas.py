"""`runtime.text_deltas.TextDeltas`: a sample's text returned a delta at a time adds up to the
whole decode, never cuts a multi-byte character, keeps SentencePiece-style leading spaces, and
holds back what a stop string may still cut."""

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from vexact_models.runtime.text_deltas import TextDeltas

TEXT = "Déjà vu: 中文字符 and emoji 🙂 mixed with plain words, spaces  and\nnew lines."


def _byte_level_tokenizer():
    """A byte-level BPE trained on a little text: multi-byte characters span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT.lower(), "plain words"], trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def _metaspace_tokenizer():
    """SentencePiece's way: a word's leading space is part of its token, dropped at a decode's start."""
    words = TEXT.split()
    tok = Tokenizer(models.WordLevel({**{f"▁{w}": i for i, w in enumerate(words)}, "<unk>": len(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def test_deltas_add_up_to_the_whole_decode():
    for tokenizer in (_byte_level_tokenizer(), _metaspace_tokenizer()):
        ids = tokenizer(TEXT)["input_ids"]
        whole = tokenizer.decode(ids)
        assert len(ids) > 10
        texts = TextDeltas(tokenizer)
        deltas = [texts.feed(ids[:i]) for i in range(1, len(ids) + 1)]
        assert "".join(deltas) == whole and not any("\ufffd" in d for d in deltas)
        assert texts.finish(whole) == ""


def test_holdback_keeps_the_end_until_finish():
    tokenizer = _metaspace_tokenizer()
    ids = tokenizer(TEXT)["input_ids"]
    texts = TextDeltas(tokenizer, holdback=4)
    for i in range(1, len(ids) + 1):
        texts.feed(ids[:i])
        assert texts.emitted <= max(0, len(texts.text) - 4)
    whole = tokenizer.decode(ids)
    cut = whole[:len(whole) - 2]  # as a stop string found at the end would cut it
    assert whole[:texts.emitted] + texts.finish(cut) == cut
