"""A real uvicorn server on a free loopback port, for serving tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from nemo_fp4qat.serve import create_app


@contextlib.contextmanager
def running_server(backend, settings):
    """A real uvicorn server for ``create_app(backend, settings)`` on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(
        uvicorn.Config(create_app(backend, settings), host="127.0.0.1", port=port, log_level="warning")
    )
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        th.join(10)


def char_tokenizer():
    """A character-level tokenizer over the tiny models' vocabulary (one token per printable character)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tiny_models import VOCAB

    chars = [chr(c) for c in range(32, 32 + VOCAB - 2)]
    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", pad_token="</s>")
