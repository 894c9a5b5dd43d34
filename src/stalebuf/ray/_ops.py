"""The producer operations a client sends: each built from the arguments of the client's call,
checked and copied as the local buffer checks and copies them (so a bad argument raises the local
error here, before the actor is asked), then sent as a record of ``_protocol``."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from .._validation import check_generation_seconds, materialise
from .._versions import check_group_versions, check_start_version
from ..buffer import GroupStatus
from ._protocol import AddPrompt, PutGroup

__all__ = ["add_prompt_op", "plain_tags", "put_group_op"]


def plain_tags(tags: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """Return ``tags`` as a plain dict (a mappingproxy does not pickle); anything that is not a
    mapping goes as it is, for the actor to reject with the local buffer's error."""
    return dict(tags) if isinstance(tags, Mapping) else tags


def add_prompt_op(
    token: str | None, uid: str, global_steps: int | None, partition: str, tags: Mapping[str, Any] | None
) -> AddPrompt:
    """The ``add_prompt`` operation (with a token it may wait for admission)."""
    return AddPrompt(token, uid, global_steps, partition, plain_tags(tags))


def _group_versions(
    count: int, versions: object, tokens: object
) -> tuple[list[tuple[tuple[int, int], ...] | None] | None, list[int] | None]:
    """``put_group``'s per-trajectory versions and tokens, checked and copied as the local buffer
    takes them (None, None when neither was given).

    Raises:
        TypeError, ValueError: as the local ``put_group`` refuses them.
    """
    rows = check_group_versions(count, versions, tokens)
    if rows is None:
        return None, None
    return [segments or None for segments, _ in rows], [total for _, total in rows]


def put_group_op(
    token: str | None,
    uid: str,
    payloads: Collection[Any],
    global_steps: int | None,
    partition: str,
    tags: Mapping[str, Any] | None,
    trajectory_tags: Sequence[Mapping[str, Any] | None] | None,
    session_ids: Sequence[int] | None,
    indices: Sequence[int] | None,
    status: GroupStatus,
    versioning: tuple[Any, Any, int | None] = (None, None, None),
    generation_seconds: float | None = None,
) -> PutGroup:
    """The ``put_group`` operation (with a token a new group may wait for admission);
    ``versioning`` is its ``(versions, tokens, version)``.

    Raises:
        TypeError: ``payloads`` is not a collection of per-trajectory items, or a per-trajectory
            collection cannot be iterated.
        ValueError: a per-trajectory collection's ``len()`` disagrees with what it yields.
        TypeError, ValueError: ``versions``, ``tokens``, ``version`` or ``generation_seconds``
            as the local ``put_group`` refuses them.
    """
    if isinstance(payloads, (str, bytes, Mapping)) or not isinstance(payloads, Collection):
        raise TypeError(f"payloads must hold one item per trajectory, got {type(payloads).__name__}")
    # Copied as the local buffer copies them, so a collection that lies about its length or whose
    # iteration raises fails here with the local error, not with whatever it yielded in the actor.
    items = materialise("payloads", payloads)
    sessions = None if session_ids is None else list(materialise("session_ids", session_ids))
    positions = None if indices is None else list(materialise("indices", indices))
    per_tags = None if trajectory_tags is None else materialise("trajectory_tags", trajectory_tags)
    versions, tokens = _group_versions(len(items), versioning[0], versioning[1])
    version = None if versioning[2] is None else check_start_version(versioning[2])
    return PutGroup(
        token,
        uid,
        list(items),
        global_steps,
        partition,
        plain_tags(tags),
        None if per_tags is None else [plain_tags(t) for t in per_tags],
        sessions,
        positions,
        status,
        versions,
        tokens,
        version,
        check_generation_seconds(generation_seconds),
    )
