"""Chapter 08: incremental detokenization never emits a broken character, and its pieces add up to
the whole text, for any text and any split of its tokens into steps."""

import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import miniinfer as mi
from miniinfer.serving.detokenize import IncrementalDetokenizer, fast_decode

TOKENIZER = mi.load_tokenizer(None)
CHARS = list("ab \n\t(){}:=_") + ["é", "ü", "日", "本", "🙂", "👍", "\U0001F3FD", "ß", "\u0301"]
TEXT = st.text(alphabet=st.sampled_from(CHARS), max_size=40)


def stream(ids: list[int], sizes: list[int]) -> list[str]:
    detok, pieces, i = IncrementalDetokenizer(TOKENIZER), [], 0
    for n in sizes:
        pieces.append(detok.add(ids[i:i + n]))
        i += n
    pieces.append(detok.add(ids[i:]))
    return pieces + [detok.finish()]


@settings(max_examples=200, deadline=None)
@given(text=TEXT, sizes=st.lists(st.integers(1, 3), max_size=40))
def test_pieces_are_whole_characters_and_add_up(text, sizes):
    ids = TOKENIZER(text).input_ids
    pieces = stream(ids, sizes)
    assert "".join(pieces) == TOKENIZER.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces[-1] == ""  # complete characters go out as soon as their last token arrives


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 4095), max_size=30), sizes=st.lists(st.integers(1, 3), max_size=30))
def test_arbitrary_tokens_still_add_up(ids, sizes):
    # A sampled model may emit bytes that never form a character: they still come out, at the end.
    assert "".join(stream(ids, sizes)) == TOKENIZER.decode(ids)


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, TOKENIZER.vocab_size - 1), max_size=60))
def test_fast_decode_is_the_tokenizers_decode(ids):
    """Special tokens (EOS included) kept, bytes of broken characters as transformers gives them."""
    assert fast_decode(TOKENIZER)(ids) == TOKENIZER.decode(ids)


def test_fast_decode_leaves_a_tokenizer_that_cleans_up_spaces_to_transformers(tmp_path):
    TOKENIZER.save_pretrained(tmp_path)
    cleaning = transformers.AutoTokenizer.from_pretrained(tmp_path, clean_up_tokenization_spaces=True)
    assert fast_decode(cleaning) == cleaning.decode
    assert fast_decode(TOKENIZER) != TOKENIZER.decode  # the course tokenizer takes the fast path
