"""Text that ships with every Python: its own documentation (`pydoc_data.topics`, about 465,000
characters), as character codes. No download."""
import numpy as np
import pydoc_data.topics


def character_codes(num_chars=None):
    """(int32 codes of the first num_chars characters, vocabulary size): characters seen at least 20
    times get their own code (from 2), any rarer one code 1; 0 is never used."""
    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))[:num_chars]
    raw = np.frombuffer(text.encode("ascii", "replace"), np.uint8)
    chars, counts = np.unique(raw, return_counts=True)
    vocab = np.full(256, 1, np.int32)
    vocab[chars[counts >= 20]] = np.arange(2, 2 + (counts >= 20).sum())
    return vocab[raw], int(vocab.max()) + 1


def next_character(codes, context, stride):
    """(windows of `context` codes starting every `stride` characters, the code that follows each)."""
    starts = np.arange(0, len(codes) - context, stride)
    return codes[starts[:, None] + np.arange(context)], codes[starts + context]
