"""``--compile`` (each decoder block under ``torch.compile``): the same losses as eager on one
process and under context parallelism (2 gloo ranks, the CP layer a custom op in the graph), no
recompile for the new mask and plan of every batch, and no attention timing."""

import json

import pytest
import torch

from flashmask3.train.config import from_preset
from flashmask3.train.model import StepContext, Transformer
from flashmask3.train.trainer import train
from tests.helpers import logged

TOL = dict(rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("cp,extra", [
    (1, {}),
    (2, dict(activation_checkpointing=True)),  # the CP op runs again in the recomputation
    # the dense-mask baseline with recomputation (its callable once memoised a mask inside the
    # compiled forward, and the recomputed block differed)
    (1, dict(attention="sdpa", activation_checkpointing=True)),
])
def test_compiled_blocks_train_like_eager(tmp_path, jsonl_corpus, cp, extra):
    settings = dict(data=jsonl_corpus, steps=3, checkpoint_every=0, seq_len=256, batch_size=2, cp=cp,
                    dist_timeout=120.0, **extra)
    for name, compiled in (("eager", False), ("compiled", True)):
        train(from_preset("tiny", out_dir=str(tmp_path / name), compile=compiled, **settings))
    want, got = logged(tmp_path / "eager"), logged(tmp_path / "compiled")
    assert len(got) == 3 and got == pytest.approx(want, **TOL)
    summary = json.loads((tmp_path / "compiled" / "summary.json").read_text())
    assert summary["attention_share"] is None  # the timer's marks cannot sit in a compiled graph


def test_compile_blocks_makes_one_graph_for_every_mask(jsonl_corpus):
    """The blocks share one compiled graph (fullgraph: a break would raise), and batches with
    other document layouts (a new mask each) reuse it."""
    import torch._dynamo.utils as dynamo_utils

    from flashmask3 import masks as M
    from flashmask3.train.attention import make_attention

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    cfg = from_preset("tiny", data=jsonl_corpus, n_layers=3)
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.compile_blocks()
    tokens = torch.randint(0, 256, (1, 128))
    for docs in ([100, 28], [64, 64], [10, 50, 68]):
        mask = M.causal_document_mask(docs)
        pos = torch.cat([torch.arange(n) for n in docs])[None]
        ctx = StepContext(make_attention("flashmask3", mask), num_tokens=128)
        logits, _ = model(tokens, pos, ctx)
        logits.sum().backward()
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1
