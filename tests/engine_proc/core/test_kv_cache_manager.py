import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

from engine_proc.core.kv_cache_manager import KVCacheManager, block_hash, root_hash
from engine_proc.core.request import Sequence
from engine_proc.detokenizer import IncrementalDetokenizer
from engine_proc.outputs import RequestMetrics
from engine_proc.sampling_params import SamplingParams
from tests.engine_fixtures import CharTokenizer

REPO = Path(__file__).resolve().parents[3]


def make_seq(tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(
        request_id="r",
        index=0,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        params=SamplingParams(),
        seed=0,
        detokenizer=IncrementalDetokenizer(CharTokenizer(100), tokens, []),
        metrics=RequestMetrics(0.0, None, None, None),
        root_hash=root_hash("model", salt),
        max_total_tokens=10_000,
        eos_token_ids=frozenset(),
    )


def run_prompt(kv: KVCacheManager, seq: Sequence) -> int:
    cached = kv.find_cached_prefix(seq)
    kv.allocate(seq, seq.num_tokens - len(cached) * kv.block_size, cached)
    seq.num_computed_tokens = seq.num_tokens
    return len(cached) * kv.block_size


# sha256 digests computed once and pinned: a change of the hash (its input layout, the seed
# text, the salt tagging) invalidates every stored prefix and must be deliberate.
GOLDEN = {
    "root": "ffd9069a807600d6e554969955eca1b74fd58b053386d86413c95363ebae42eb",
    "block": "afdddafa40a8146305411e7669aa4fd0c2cec7ac80f2568f0c34e9a297426f39",
    "salted": "c4676b4287260e1aa70a276dee655f9cc0ea077f06138e67fde1c629330c59f6",
}
DIGESTS = (
    "from engine_proc.core.kv_cache_manager import block_hash, root_hash\n"
    "r = root_hash('m', None)\n"
    "print(r.hex(), block_hash(r, [1, 2, 3]).hex(), root_hash('m', 'alice').hex())\n"
)


def test_hash_is_a_pinned_digest_in_every_process():
    # Independent of the code: the documented layout (seed text, model id; token ids as
    # little-endian int32 after the parent digest).
    root = hashlib.sha256(b"kvscope-prefix-v1\0model\0m").digest()
    assert root.hex() == GOLDEN["root"]
    assert hashlib.sha256(root + struct.pack("<3i", 1, 2, 3)).hexdigest() == GOLDEN["block"]
    # Other interpreters with different string-hash seeds give the same digests.
    for seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        out = subprocess.run(
            [sys.executable, "-c", DIGESTS], env=env, cwd=REPO, capture_output=True, text=True,
            timeout=120, check=True,
        ).stdout.split()  # fmt: skip
        assert out == [GOLDEN["root"], GOLDEN["block"], GOLDEN["salted"]], seed


def test_hash_is_chained_and_typed():
    r = root_hash("m", None)
    assert block_hash(r, [1, 2, 3]) != block_hash(block_hash(r, [0]), [1, 2, 3])
    # Typed extra keys: a salt never collides with a model name.
    assert root_hash("m", "x") != root_hash("mx", None) != root_hash("m", "")


def test_prefix_match_stops_at_first_miss_and_keeps_last_token():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=True)
    a = make_seq(list(range(12)))
    assert run_prompt(kv, a) == 0
    # Same 12 tokens: only 2 blocks hit, the last token must be recomputed.
    assert run_prompt(kv, make_seq(list(range(12)))) == 8
    # Differs inside block 1: only block 0 hits, even though block 2 matches again.
    b = list(range(12))
    b[5] = 99
    assert run_prompt(kv, make_seq(b + [50])) == 4
    assert run_prompt(kv, make_seq(list(range(12)), salt="alice")) == 0


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    parent = make_seq(list(range(6)))
    run_prompt(kv, parent)
    child = make_seq(list(range(6)))
    kv.fork(parent, child)
    assert [kv.pool.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    for seq in (parent, child):
        seq.token_ids.append(7)
    copies = kv.allocate(child, 1, [])
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]  # the full block stays shared
    assert kv.pool.blocks[parent.block_table[1]].ref_count == 1
    assert kv.allocate(parent, 1, []) == []  # sole owner now: writes in place


def test_free_releases_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    seq = make_seq(list(range(6)))
    run_prompt(kv, seq)
    table = list(seq.block_table)
    kv.free(seq)
    assert list(kv.pool.free_queue)[-3:] == table[::-1]
    assert kv.pool.num_free == 8


def test_sliding_tables_are_freed_head_first():
    """A sliding window's hit needs the window's last blocks (the same chat's next turn), so
    those go last to the free queue's evicting end; a full table's head goes last."""
    sliding = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True, windows=(4,))
    seq = make_seq(list(range(6)))
    run_prompt(sliding, seq)
    table = list(seq.block_table)
    sliding.free(seq)
    assert list(sliding.pool.free_queue)[-3:] == table and sliding.pool.num_free == 8
    hybrid = KVCacheManager(num_blocks=16, block_size=2, enable_caching=True, windows=(None, 4))
    seq = make_seq(list(range(6)))
    run_prompt(hybrid, seq)
    full, window = list(seq.block_table), list(seq.group_tables[0])
    hybrid.free(seq)
    # the sliding group first, head first; then the full group, tail first
    assert list(hybrid.pool.free_queue)[-6:] == window + full[::-1]
    assert hybrid.pool.num_free == 16
