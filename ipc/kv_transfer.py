"""KV block transfer between a prefill and a decode engine (prefill/decode disaggregation).

A prefill engine (`--role prefill`) binds one more socket, a ROUTER (its *transfer endpoint*),
where decode engines pull the KV blocks of finished prompts (docs/PROTOCOL.md section 10):

    decode DEALER -> prefill ROUTER   one frame: KVPull (lease id, the block hashes it lacks)
    prefill ROUTER -> decode DEALER   per block, two frames: KVBlockHeader, then the raw block
                                      (the pool's bytes, CRC-32 in the header); then one frame:
                                      KVPullDone (how many blocks, or why none)

Blocks are addressed by their prefix-chain hash, never by pool position, so the decode side
adopts them into its own pool and prefix index exactly as it would load them from a KV tier. No
pickle: headers are MessagePack maps, payloads raw bytes checked against their CRC-32.

Nothing here imports torch, Qt or engine_proc.
"""

from __future__ import annotations

import zlib
from typing import Annotated, Any

import msgspec

MAX_PULL_MESSAGE_BYTES = 1 << 20  # what the transfer ROUTER accepts (a KVPull)
MAX_HASHES_PER_PULL = 16_384  # 256k tokens of 16-token blocks
HASH_BYTES = 32  # sha256 chain hashes

# KVPullDone.code
PULL_OK = "ok"
PULL_UNAUTHORIZED = "unauthorized"
PULL_UNKNOWN_LEASE = "unknown_lease"  # never granted, already pulled, or expired
PULL_IDENTITY_MISMATCH = "identity_mismatch"  # another model, dtype, KV dtype or block size
PULL_UNKNOWN_BLOCK = "unknown_block"  # a hash the lease does not hold
PULL_BAD_MESSAGE = "bad_message"
PULL_CODES = (
    PULL_OK,
    PULL_UNAUTHORIZED,
    PULL_UNKNOWN_LEASE,
    PULL_IDENTITY_MISMATCH,
    PULL_UNKNOWN_BLOCK,
    PULL_BAD_MESSAGE,
)

BlockHash = Annotated[bytes, msgspec.Meta(min_length=HASH_BYTES, max_length=HASH_BYTES)]
_STRICT: dict[str, Any] = dict(kw_only=True, forbid_unknown_fields=True, omit_defaults=True)


class KVPull(msgspec.Struct, tag="kv_pull", tag_field="kind", **_STRICT):
    lease_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    block_hashes: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_HASHES_PER_PULL)]
    cache_identity: str  # the puller's: must equal the prefill engine's (same K/V contents)
    token: str | None = None  # the prefill engine's access token, when it has one
    release: bool = True  # end the lease once these blocks are sent


class KVBlockHeader(msgspec.Struct, tag="kv_block", tag_field="kind", **_STRICT):
    lease_id: str
    index: int  # position in KVPull.block_hashes
    block_hash: bytes
    num_bytes: int
    crc32: int


class KVPullDone(msgspec.Struct, tag="kv_pull_done", tag_field="kind", **_STRICT):
    lease_id: str
    num_blocks: int  # blocks sent before this message
    code: str = PULL_OK
    message: str = ""


TransferMessage = KVPull | KVBlockHeader | KVPullDone
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TransferMessage)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> TransferMessage:
    """Raises msgspec.DecodeError / msgspec.ValidationError on anything malformed."""
    return _decoder.decode(data)


def checksum(payload: bytes | memoryview) -> int:
    return zlib.crc32(payload) & 0xFFFFFFFF


def block_frames(lease_id: str, index: int, block_hash: bytes, payload: bytes) -> list[bytes]:
    """The two frames that carry one block."""
    header = KVBlockHeader(
        lease_id=lease_id,
        index=index,
        block_hash=block_hash,
        num_bytes=len(payload),
        crc32=checksum(payload),
    )
    return [encode(header), payload]


def check_block(header: KVBlockHeader, payload: bytes, expected: bytes, block_bytes: int) -> str:
    """Why a received block must not be used ('' when it is fine)."""
    if header.block_hash != expected:
        return f"block {header.index}: hash {header.block_hash.hex()[:12]} was not asked for"
    if header.num_bytes != len(payload) or len(payload) != block_bytes:
        return (
            f"block {header.index}: {len(payload)} bytes, header says {header.num_bytes}, "
            f"this pool's blocks have {block_bytes}"
        )
    if checksum(payload) != header.crc32:
        return f"block {header.index}: CRC-32 mismatch (corrupted in transit)"
    return ""
