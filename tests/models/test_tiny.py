"""The tiny models' character tokenizer."""

from megatron_armor.models.tiny import make_char_tokenizer


def test_char_tokenizer_round_trips_newline_and_tab_and_keeps_printable_ids():
    tokenizer = make_char_tokenizer()
    for text in ("a\nb\tc", "\n\n1+2= x\t"):
        ids = tokenizer.encode(text)
        assert len(ids) == len(text) and tokenizer.eos_token_id not in ids, text
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("0 \n\t") == [1, 95, 96, 97]  # printable ids as before; newline and tab appended
    assert len(tokenizer) == 98
