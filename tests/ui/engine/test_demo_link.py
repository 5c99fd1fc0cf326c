"""The demo's link (`kvscope --demo`): its engine controls answer as a real engine's do."""

from __future__ import annotations

from ui.engine.demo import DemoLink


def test_the_prefill_chunk_goes_back_to_the_engines_rule(qtbot):
    demo = DemoLink()
    acks = []
    demo.control_reply.connect(acks.append)
    demo.control("set_limits", long_prefill_chunk=64)
    assert (acks[-1].config.long_prefill_chunk, acks[-1].config.long_prefill_chunk_default) == (
        64, False)
    demo.control("set_limits", default_prefill_chunk=True)  # the window's "auto" box
    assert (acks[-1].config.long_prefill_chunk, acks[-1].config.long_prefill_chunk_default) == (
        512, True)
    demo.control("set_limits", max_num_seqs=8)  # later controls still answer
    assert acks[-1].config.max_num_seqs == 8 and acks[-1].config.long_prefill_chunk_default
    demo.stop()
