"""The identity of a full KV block for the prefix cache: a hash chain over the block's tokens and its prefix.

A block's K/V depend on every token before it, not only its own, so two blocks hold the same K/V exactly when
their whole prefixes are equal. The key of block i is therefore H(key of block i-1, token ids of block i): equal
keys mean equal prefixes, and a lookup walks a request's keys from the first block until one is missing.

Why a cryptographic digest (BLAKE2b, 256 bits) and not Python's `hash()` or exact tuples:
- `hash()` of ints is 64-bit and trivially collides (hash(-1) == hash(-2)); a collision here silently feeds a
  request another prompt's K/V, so "unlikely" is not enough: with 256 bits the chance that any two of 10^12
  distinct blocks share a key is below 10^-53, far below the rate of undetected hardware memory errors.
- An exact key (the tuple of every token of the prefix) is collision-free but costs O(prefix) memory per
  block and O(prefix) per lookup; a nested (parent_key, tokens) tuple is exact too, but Python does not cache
  tuple hashes, so every dict lookup rehashes the whole chain. A digest is 32 bytes and hashes in O(block).

A LoRA adapter changes every layer's K/V, so a request of an adapter starts its chain from the adapter's own root
key (`adapter_root_key`, a digest of its name and directory: an adapter unloaded and loaded again under the
same name from elsewhere is another adapter) instead of no parent: two adapters, or an adapter and the base
model, never share a block of the same prompt, and the base model's keys are what they were without LoRA.

Token ids are packed as signed 64-bit integers, so any id a tokenizer produces fits; the byte order is the
machine's, which is fine because keys never leave the scheduler process.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockKey = bytes  # 32-byte digest

_DIGEST_SIZE = 32
_NO_PARENT = b""


def chain_block_key(parent: BlockKey | None, token_ids: Sequence[int]) -> BlockKey:
    """The key of a full block holding `token_ids`, after the block whose key is `parent` (None: the first)."""
    digest = hashlib.blake2b(parent or _NO_PARENT, digest_size=_DIGEST_SIZE)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def adapter_root_key(lora_name: str, lora_path: str, lora_generation: int = 0) -> BlockKey:
    """The parent key of a LoRA adapter's first block: a digest of its name, directory and load generation (a
    reload may bring other weights), in a domain of its own (no token block hashes to it). Generation 0 (the
    adapters of --lora-modules) keeps the digest of name and directory alone."""
    identity = f"{lora_name}\0{lora_path}" + (f"\0{lora_generation}" if lora_generation else "")
    return hashlib.blake2b(identity.encode(), digest_size=_DIGEST_SIZE,
                           person=b"pagedserve-lora").digest()
