"""dispatcher/server.py's durable-reply gate: a reply that acknowledges journal lines goes out only
once the journal has them on disk, and never when the journal failed. The witness is the journal's
own ``synced_seq`` read at the moment the reply is sent."""

import select

from common import faults
from common.run.records.events import StepCommitted
from common.wire import messages
from common.wire.messages import ErrorCode
from dispatcher.journal import Journal
from dispatcher.server import DurableReplies


def commit(step: int) -> StepCommitted:
    return StepCommitted(model="m", step=step, jobs=[step], w="d0.0")


class Sent:
    """What the gate sends, with how far the journal was on disk at that moment."""

    def __init__(self, journal: Journal):
        self.journal = journal
        self.replies: list[tuple[bytes, messages.Reply, int]] = []

    def __call__(self, identity: bytes, reply: messages.Reply) -> None:
        self.replies.append((identity, reply, self.journal.synced_seq))


def wait_for_sync(journal: Journal) -> None:
    assert select.select([journal.notify_fd], [], [], 60.0)[0], "the journal's sync thread never reported"
    journal.drain_notifications()


def test_replies_go_out_only_once_their_lines_are_durable(tmp_path):
    journal = Journal(tmp_path, sync_in_background=True)
    sent = Sent(journal)
    gate = DurableReplies(journal, sent)
    answered_now = []
    for step in (1, 2, 3):
        journal.record(commit(step), durable=True)
        reply = gate.when_durable(f"w{step}".encode(), messages.Ack(id=step))
        if reply is not None:  # the sync thread was already done: on disk as the reply is returned
            assert journal.synced_seq >= step
            answered_now.append(step)
    while len(sent.replies) + len(answered_now) < 3:
        wait_for_sync(journal)
        gate.release()
    assert gate.held == []
    for identity, reply, synced in sent.replies:
        assert identity == f"w{reply.id}".encode() and synced >= reply.id
    assert sorted([reply.id for _, reply, _ in sent.replies] + answered_now) == [1, 2, 3]
    journal.close()


def test_an_inline_journal_answers_at_once(tmp_path):
    journal = Journal(tmp_path)
    sent = Sent(journal)
    gate = DurableReplies(journal, sent)
    journal.record(commit(1), durable=True)
    reply = messages.Ack(id=1)
    assert gate.when_durable(b"w", reply) is reply and sent.replies == []
    journal.close()


def test_a_failed_journal_answers_what_it_held_with_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "journal_fsync_fails_after=0")
    journal = Journal(tmp_path, sync_in_background=True)
    sent = Sent(journal)
    gate = DurableReplies(journal, sent)
    journal.record(commit(1), durable=True)
    assert gate.when_durable(b"w", messages.CommitReply(id=5, step=1, done=False)) is None
    wait_for_sync(journal)
    assert journal.failed is not None
    gate.release()
    assert sent.replies == []  # nothing acknowledged that is not on disk
    journal.close()
    gate.close()
    [(identity, reply, synced)] = sent.replies
    assert identity == b"w" and synced == 0
    assert isinstance(reply, messages.ErrorReply) and reply.id == 5 and reply.error.code == ErrorCode.INTERNAL
