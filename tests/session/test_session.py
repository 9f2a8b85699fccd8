"""Sessions: a document read once serves many questions, each seeing only its own turn; stored
states are found again by a new session; cancelled answers leak nothing."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tierkv.errors import BlockMissing, BudgetExceeded, ConfigError, TierKVError
from tierkv.model.arch import model_spec
from tierkv.model.loading import LoadedModel
from tierkv.model.sequence import TieredSequence
from tierkv.model.settings import SessionConfig
from tierkv.session import Session
from tierkv.session.inputs import document_text
from tierkv.session.session import Cancelled
from tierkv.session.generation import Sampling
from tierkv.session.state import DenseState

from tinymodels import TINY, tiny_model

DOC = ("Alice met Bob in Paris in 1999. They founded a bakery called Blue Oven on Rue Cler. "
       "The bakery became famous for its rye bread. In 2010 they opened a second shop in Lyon.\n") * 12
SMALL = dict(gpu_budget="32MiB", cpu_budget="32MiB")   # spilling is the tiers' tests; these test reuse


def smollm2_session(smollm2, tmp_path, **settings) -> Session:
    return Session.open("smollm2", loaded=smollm2, nvme_dir=tmp_path / "store", **SMALL, **settings)


def assert_only_documents_held(session: Session) -> None:
    """Nothing pinned in any tier; every held block belongs to a state the session keeps."""
    for backend in session.backends.values():
        backend.manager.flush()                  # (dense mode writes computed blocks back to the store meanwhile)
        mgr = backend.manager.manager
        assert all(mgr.tiers[name].pool.busy_slots() == 0 for name in mgr.order)
        assert not mgr.directory.wanted


@pytest.mark.model
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_each_question_sees_the_document_and_only_its_own_turn(smollm2, tmp_path, mode):
    with smollm2_session(smollm2, tmp_path / "one", mode=mode) as session:
        doc_tokens = session.read(DOC)
        first = session.ask("Who founded the bakery?", max_new_tokens=12)
        second = session.ask("In which city was the second shop?", max_new_tokens=12)
        assert second.reused_tokens >= doc_tokens - 256 and second.prompt_tokens - second.reused_tokens < 300
        assert_only_documents_held(session)
    with smollm2_session(smollm2, tmp_path / "two", mode=mode) as fresh:
        fresh.read(DOC)
        alone = fresh.ask("In which city was the second shop?", max_new_tokens=12)
    assert second.text == alone.text and first.text != second.text       # the first question left no trace
    assert second.tokens == alone.tokens


@pytest.mark.model
def test_a_new_session_finds_the_stored_document(smollm2, tmp_path):
    with smollm2_session(smollm2, tmp_path, mode="sparse") as session:
        n = session.read(DOC)
        assert session.document_reused == 0
        before = session.ask("Who founded the bakery?", max_new_tokens=8)
    with smollm2_session(smollm2, tmp_path, mode="sparse") as again:      # a new process would do the same
        again.read(DOC)
        assert again.document_reused == n
        after = again.ask("Who founded the bakery?", max_new_tokens=8)
        with pytest.raises(ConfigError, match="ask something"):
            again.ask("  ")
    assert after.tokens == before.tokens


@pytest.mark.model
def test_a_stopped_answer_and_a_request_sent_again_go_on_from_the_state_they_left(smollm2, tmp_path):
    """An answer stopped part-way (Ctrl-C in ``tierkv chat``) is the conversation's turn: the next turn,
    which repeats it as far as it came, goes on from its state, where it used to go on from the document
    alone. A request sent again goes on from its first answer's state, cropped to the prompt."""
    with smollm2_session(smollm2, tmp_path, mode="dense") as session:
        session.read(DOC)
        asked = [{"role": "user", "content": DOC}, {"role": "user", "content": "Tell me all about the bakery."}]
        stop = threading.Event()
        stream = session.chat(asked, stream=True, cancelled=stop.is_set, max_new_tokens=64)
        for n, _ in enumerate(stream):
            if n == 20:
                stop.set()
        stopped = stream.answer
        assert stopped.finish_reason == "cancelled" and stopped.generated_tokens >= 20
        turn = [*asked, {"role": "assistant", "content": stopped.text}, {"role": "user", "content": "Where is it?"}]
        after = session.chat(turn, max_new_tokens=4)
        assert after.reused_tokens >= stopped.prompt_tokens + stopped.generated_tokens - 2
        assert after.prompt_tokens - after.reused_tokens < 20                    # the new question's turn

        again = session.chat(turn, max_new_tokens=4)
        assert again.reused_tokens == again.prompt_tokens - 1 and again.tokens == after.tokens

        kept = list(session._states)                 # a stopped answer whose stream is closed: a client that left
        stop.clear()
        left = session.chat(turn, stream=True, cancelled=stop.is_set, max_new_tokens=64)
        for n, _ in enumerate(left):
            if n == 2:
                stop.set()
        left.close()
        assert left.answer.finish_reason == "cancelled" and all(state in kept for state in session._states)
        assert_only_documents_held(session)
        stop.clear()
        late = session.fork().chat(turn, stream=True, cancelled=stop.is_set, max_new_tokens=64)
        for n, _ in enumerate(late):
            if n == 2:
                stop.set()
    late.close()                 # after the tiers closed with the session: nothing to let go of, and no error


@pytest.mark.model
def test_threads_sharing_a_session_get_the_answers_each_gets_alone(smollm2, tmp_path, monkeypatch):
    """A turn that chose a kept conversation forks it while another thread's answer ends and pushes that
    conversation out (``max_states=1``): the fork raised "this dense state was released"; the other answer
    now waits for it. Streams read side by side from four threads give the answers each gets alone. A fork
    closed while its answer streams lets go of that answer's state as the stream closes (it kept it), as
    does a stream closed through ``iter()`` before its first piece; a question asked while another thread
    reads a new document waits for it (it raised "read a document first")."""
    import tierkv.session.session as module
    config = SessionConfig.of(model="smollm2", nvme_dir=tmp_path / "store", mode="dense", **SMALL)
    with Session(config, loaded=smollm2, max_states=1) as session:
        session.read(DOC)
        asked = [{"role": "user", "content": DOC}, {"role": "user", "content": "Tell me about the bakery."}]
        first = session.chat(asked, max_new_tokens=6)
        turn = [*asked, {"role": "assistant", "content": first.text}, {"role": "user", "content": "Where is it?"}]
        other = [asked[0], {"role": "user", "content": "Who founded it?"}]
        questions = ["Who met Bob?", "What bread is it famous for?", "Where is the second shop?", "When?"]
        with session.fork() as alone:
            want = {name: alone.chat(messages, max_new_tokens=6).tokens for name, messages in
                    (("turn", turn), ("other", other))}
            want |= {q: alone.ask(q, max_new_tokens=8).tokens for q in questions}

        real_fork_at, forking, ended = module.fork_at, threading.Event(), threading.Event()

        def slow_fork_at(state, tokens):
            if threading.current_thread() is later:    # without the session's lock the other answer ends meanwhile
                forking.set()
                ended.wait(3)
            return real_fork_at(state, tokens)

        monkeypatch.setattr(module, "fork_at", slow_fork_at)
        got, errors = {}, []

        def answer(name, request):
            try:
                got[name] = request()
            except Exception as error:          # noqa: BLE001 - the test reports it
                errors.append(error)

        later = threading.Thread(target=answer, args=("turn", lambda: session.chat(turn, max_new_tokens=6)))
        later.start()
        assert forking.wait(60)
        answer("other", lambda: session.chat(other, max_new_tokens=6))
        ended.set()
        later.join()
        assert not errors, errors
        assert got["turn"].tokens == want["turn"] and got["other"].tokens == want["other"]
        assert got["turn"].reused_tokens > first.prompt_tokens     # it went on from the kept conversation

        def streamed(question):
            def read():
                stream = session.ask(question, stream=True, max_new_tokens=8)
                "".join(stream)
                return stream.answer
            return read

        threads = [threading.Thread(target=answer, args=(q, streamed(q))) for q in questions]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert {q: got[q].tokens for q in questions} == {q: want[q] for q in questions}
        assert_only_documents_held(session)

        released, real_release = [], DenseState.release
        monkeypatch.setattr(DenseState, "release", lambda state: (released.append(state), real_release(state))[1])
        fork = session.fork()
        stream = fork.ask(questions[0], stream=True, max_new_tokens=8)
        next(stream)
        fork.close()                            # (another thread's, say) while its answer runs
        before = len(released)
        stream.close()
        assert len(released) == before + 1      # its answer's state let go of
        unread = session.ask(questions[0], stream=True, max_new_tokens=8)
        iter(unread).close()                    # closed through what iter() gave, before its first piece
        assert len(released) == before + 2

        reading, old_prompt = threading.Event(), session.ask(questions[1], max_new_tokens=1).prompt_tokens

        def read_slowly(tokens: int) -> None:
            reading.set()
            threading.Event().wait(0.5)

        changed = DOC + "A new line.\n"
        reader = threading.Thread(target=answer, args=("read", lambda: session.read(changed, progress=read_slowly)))
        reader.start()
        assert reading.wait(60)
        asked_meanwhile = session.ask(questions[1], max_new_tokens=2)  # it raised "read a document first"
        reader.join()
        assert not errors, errors
        assert asked_meanwhile.prompt_tokens == session.ask(questions[1], max_new_tokens=1).prompt_tokens > \
            old_prompt                                          # asked of the new document, not the old


@pytest.mark.model
def test_a_turn_after_its_conversation_was_let_go_of_finds_its_blocks_stored(smollm2, tmp_path):
    """A conversation the session no longer holds (``max_states=0`` here; a busy server's turns push
    each other out) is stored: its next turn, which goes on from the document's state, adopts the
    stored blocks that follow it, where it used to compute the whole conversation again."""
    config = SessionConfig.of(model="smollm2", nvme_dir=tmp_path / "store", mode="dense", block_tokens=16, **SMALL)
    with Session(config, loaded=smollm2, max_states=0) as session:
        session.read(DOC)
        asked = [{"role": "user", "content": DOC}, {"role": "user", "content": "Tell me all about the bakery."}]
        first = session.chat(asked, max_new_tokens=24)
        turn = [*asked, {"role": "assistant", "content": first.text}, {"role": "user", "content": "Where is it?"}]
        later = session.chat(turn, max_new_tokens=6)
        assert later.reused_tokens >= (first.prompt_tokens + first.generated_tokens - 1) // 16 * 16
    with smollm2_session(smollm2, tmp_path / "fresh", mode="dense", block_tokens=16) as fresh:
        assert fresh.chat(turn, max_new_tokens=6).tokens == later.tokens


def test_a_document_stored_under_another_spelling_of_its_page_format_is_named(tmp_path, caplog):
    """``int4`` and ``int4-g<head dims>`` store the same pages, but each names an index of its own (the
    pages' keys derive from it): a run that spells it otherwise computes the document again, hours at 1M
    tokens. It now says which spelling holds the document."""
    import logging
    lm = tiny_loaded()
    ids = random_ids(1200, 9)
    settings = dict(nvme_dir=tmp_path, mode="sparse", gpu_budget="1MiB", cpu_budget="2MiB", chunk_tokens=256,
                    sparse_budget=128)
    with Session(SessionConfig.of(page_dtype="int4", **settings), loaded=lm) as session:
        session.read_ids(ids)
    with caplog.at_level(logging.WARNING, logger="tierkv.session.prefill"):
        with Session(SessionConfig.of(page_dtype=f"int4-g{lm.spec.head_dim}", **settings), loaded=lm) as session:
            session.read_ids(ids)
            assert session.document_reused == 0                 # an index of its own, as before
    assert "1200 tokens of this document are stored under --page-dtype int4 (the same format" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tierkv.session.prefill"):
        with Session(SessionConfig.of(page_dtype="int8", **settings), loaded=lm) as session:
            session.read_ids(ids)                               # another format: nothing to say
    assert "stored under" not in caplog.text


def test_a_crop_into_a_block_that_cannot_be_read_computes_it_again(monkeypatch):
    """A held state is cropped to the tokens it shares with a prompt; where the block the crop ends in
    is lost or damaged, the state goes on from its tokens (found by content, the rest computed), not
    failing the request."""
    from tierkv.errors import BlockMissing
    from tierkv.model.sequence import TieredSequence
    lm = tiny_loaded()
    with Session(SessionConfig.of(nvme_dir=None, mode="dense", block_tokens=16), loaded=lm) as session:
        ids = random_ids(100, 6)
        state, _ = session.backend("dense").state_of(ids)
        fork = state.fork()

        def lost(self, tokens):
            raise BlockMissing("injected: a block of the crop is lost")
        with monkeypatch.context() as patched:
            patched.setattr(TieredSequence, "crop", lost)
            fork.crop(40)
        assert fork.tokens == ids[:60]
        cropped = fork.extend([7])
        fresh, _ = session.backend("dense").state_of([*ids[:60], 7])
        expected = fresh.extend([8])
        assert torch.allclose(fork.extend([8]), expected, atol=1e-4) and cropped.shape == expected.shape
        stepped, verified = state.fork(), state.fork()         # a decode step or a draft goes on from there too
        with monkeypatch.context() as patched:
            patched.setattr(TieredSequence, "crop", lost)
            stepped.crop(40)
            verified.crop(40)
        assert torch.allclose(stepped.step(7), cropped, atol=1e-4) and stepped.tokens == [*ids[:60], 7]
        assert torch.allclose(verified.verify([7, 8])[1], expected, atol=1e-4)
        for held in (state, fork, fresh, stepped, verified):
            held.release()


@pytest.mark.model
def test_a_fork_branches_the_conversation(smollm2, tmp_path):
    with smollm2_session(smollm2, tmp_path, mode="dense") as session:
        session.read(DOC)
        branch = session.fork()
        a = branch.ask("Who founded the bakery?", max_new_tokens=8)
        b = session.ask("Who founded the bakery?", max_new_tokens=8)
        assert a.tokens == b.tokens
        branch.close()
        assert session.ask("Where is Blue Oven?", max_new_tokens=4).generated_tokens >= 1   # the parent lives on


@pytest.mark.model
def test_a_stream_closed_midway_lets_go_of_its_state(smollm2, tmp_path):
    with smollm2_session(smollm2, tmp_path, mode="sparse") as session:
        session.read(DOC)
        stream = session.ask("Tell me everything about the bakery.", stream=True, max_new_tokens=64)
        pieces = [next(iter(stream)) for _ in range(3)]
        stream.close()
        assert pieces and stream.answer.generated_tokens < 64
        assert_only_documents_held(session)
        held = session.backends["sparse"].manager.manager.directory
        assert sum(e.holders for e in held) == len(session.document.seq.all_pages())


@pytest.mark.model
def test_sampling_is_repeatable_with_a_seed_and_stops_at_a_stop_string(smollm2, tmp_path):
    with smollm2_session(smollm2, tmp_path, mode="dense") as session:
        session.read(DOC)
        one = session.ask("Describe the bakery.", max_new_tokens=10, temperature=0.9, seed=3)
        two = session.ask("Describe the bakery.", max_new_tokens=10, temperature=0.9, seed=3)
        assert one.tokens == two.tokens
        greedy = session.ask("Describe the bakery.", max_new_tokens=20)
        word = greedy.text.split()[2]
        cut = session.ask("Describe the bakery.", max_new_tokens=20, stop=(word,))
        assert cut.finish_reason == "stop" and word not in cut.text and greedy.text.startswith(cut.text)


def test_bad_requests_are_clear_errors(tmp_path):
    lm = tiny_loaded()
    with Session(SessionConfig.of(nvme_dir=None, mode="dense"), loaded=lm) as session:
        with pytest.raises(TierKVError, match="read a document first"):
            session.ask("?")
        with pytest.raises(ConfigError, match="temperature"):
            session.complete([1, 2, 3], temperature=-1)
        with pytest.raises(ConfigError, match="messages\\[0\\]"):
            session.chat([{"role": "robot", "content": "hi"}])
        with pytest.raises(ConfigError, match="token id 128 is not in the model's vocabulary; ids are 0..127"):
            session.complete([1, 128, 2])
        for prompt, kind in ((b"abc", "bytes"), (None, "NoneType"), (5, "int")):
            with pytest.raises(ConfigError, match=f"the prompt: expected text .* or token ids .*, got {kind}"):
                session.complete(prompt)
        with pytest.raises(ConfigError, match=r"the document: not UTF-8 text \(byte 0xfe at character 1\)"):
            session.read_text("a\udcfeb")
        with pytest.raises(ConfigError, match=r"the prompt: not UTF-8 text \(byte 0xff at character 3\)"):
            session.complete("abc\udcffd")                        # bytes read with errors="surrogateescape"
        with pytest.raises(ConfigError, match=r"messages\[1\]: not UTF-8 text \(a lone surrogate U\+D800"):
            session.chat([{"role": "user", "content": "hi"}, {"role": "user", "content": "\ud800"}])
        with pytest.raises(ConfigError, match=r"messages\[0\]'s name: not UTF-8 text \(a lone surrogate U\+D800"):
            session.chat([{"role": "user", "content": "hi", "name": "\ud800"}])     # (templates that show it)
        with pytest.raises(ConfigError, match=r"messages\[0\]: 'name': expected text \(a str\), got int"):
            session.chat([{"role": "user", "content": "hi", "name": 5}])
        with pytest.raises(ConfigError, match="stream='yes': expected True or False"):
            session.complete([1, 2, 3], stream="yes")
        with pytest.raises(ConfigError, match="cancelled=5: expected a function"):
            session.complete([1, 2, 3], cancelled=5)
        with pytest.raises(ConfigError, match="max_new_tokens='5': expected an integer"):
            session.complete([1, 2, 3], max_new_tokens="5")
        with pytest.raises(ConfigError, match="unknown sampling setting\\(s\\): max_tokens; allowed: max_new_tokens"):
            session.complete([1, 2, 3], max_tokens=5)
        with pytest.raises(ConfigError, match=f"the document {tmp_path / 'nope.txt'}: no such file"):   # not --doc
            session.read(tmp_path / "nope.txt")
        (tmp_path / "report.txt").write_text("a report")
        with pytest.raises(ConfigError, match="this one is a file's name: read\\(Path\\("):   # not its name as text
            session.read(str(tmp_path / "report.txt"))
        with pytest.raises(ConfigError, match="a str \\(its text\\) or a Path \\(a text file\\), not bytes"):
            session.read(b"text")
    with pytest.raises(ConfigError, match="sparse_budget: sparse-mode settings, but mode='dense'"):   # (as given)
        Session.open("tiny", loaded=lm, mode="dense", sparse_budget=64)     # not taken and ignored
    with pytest.raises(ConfigError, match="kv_dtype: dense-mode settings, but mode='sparse'.*use mode='dense'"):
        Session.open("tiny", loaded=lm, mode="sparse", kv_dtype="int8")
    with pytest.raises(ConfigError, match="^page_dtype='int4-g3': -g3: must divide the .* channels of a head$"):
        Session.open("tiny", loaded=lm, mode="sparse", page_dtype="int4-g3")    # (it failed at the first read)
    line = "The quick brown fox jumps. " * 12                  # one line, too long for a file's name: text
    assert document_text(line) == line
    with pytest.raises(TierKVError, match="closed"):
        session.complete([1, 2])
    with pytest.raises(TierKVError, match="closed"):     # not "read a document first"
        session.ask("?")
    with pytest.raises(TierKVError, match="the session is closed"):       # not entered as if open
        with session:
            pass


def test_a_setting_named_as_a_flag_that_turns_something_off_turns_it_off():
    off = SessionConfig.of(no_reuse=True, no_sparse_overlap=True)      # --no-reuse --no-sparse-overlap
    assert not off.engine.reuse and not off.sparse.overlap
    on = SessionConfig.of(no_reuse=False, no_sparse_overlap=False)
    assert on.engine.reuse and on.sparse.overlap
    assert not on.updated(no_reuse=True).engine.reuse


def test_settings_and_messages_of_the_wrong_type_are_named(tmp_path):
    for settings, message in ((dict(nvme_dir=123), "nvme_dir=123: expected a path or None"),
                              (dict(rank="64"), "rank='64': expected an integer or None"),
                              (dict(no_reuse=1), "no_reuse=1: expected true or false")):
        with pytest.raises(ConfigError, match=message):                   # not a TypeError from inside
            SessionConfig.of(**settings)
    assert SessionConfig.of(gpu_budget=1 << 20, checkpoint_every=2).tiers.gpu_budget == 1 << 20
    taken = SessionConfig.of(model=tmp_path / "m.gguf", block_tokens=np.int64(128), checkpoint_every=np.float32(2))
    assert taken.engine.model == tmp_path / "m.gguf" and taken.engine.block_tokens == 128    # as before the checks
    with Session(SessionConfig.of(nvme_dir=None, mode="dense"), loaded=tiny_loaded()) as session:
        with pytest.raises(ConfigError, match="messages: expected a list of .* got str"):   # not "got 'h'"
            session.chat("hello")


def tiny_loaded() -> LoadedModel:
    model = tiny_model("llama")                           # trained window 512 tokens, no tokenizer
    return LoadedModel(model, None, "tiny-llama", model_spec(model))


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_seeds_that_differ_only_past_32_bits_sample_differently():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    sampled = {seed: tuple(_draws(seed, logits)) for seed in (1, 2**32 + 1, -(2**32) + 1, 2**63 - 1, -1, 2**200)}
    assert len(set(sampled.values())) == len(sampled)
    assert sampled[1] == tuple(_draws(1, logits))                    # and the same seed, the same draws


def _draws(seed: int, logits: torch.Tensor) -> list[int]:
    pick = Sampling(temperature=5.0, seed=seed).sampler()
    return [pick(logits) for _ in range(8)]


def test_sampling_settings_take_numpy_integers_and_name_the_integer_they_need():
    assert Sampling(max_new_tokens=np.int64(3), seed=np.uint32(7)) == Sampling(max_new_tokens=3, seed=7)
    with pytest.raises(ConfigError, match="max_new_tokens=2.0: expected an integer"):
        Sampling(max_new_tokens=2.0)


def test_a_session_that_reuses_nothing_leaves_nothing_in_the_store(tmp_path):
    """With reuse off a run's blocks have keys of their own, which no later run finds: kept in the store,
    each run added a copy that only took room."""
    from tierkv.tiers.nvme import NvmeTier
    lm, ids = tiny_loaded(), random_ids(700, 12)
    for _ in range(2):
        with Session(SessionConfig.of(nvme_dir=tmp_path, mode="dense", no_reuse=True), loaded=lm) as session:
            session.read_ids(ids)
            assert session.document_reused == 0
            session.complete([*ids, 3], max_new_tokens=2)
    (store,) = [p.parent for p in tmp_path.glob("*/store.json")]
    with NvmeTier.existing(store) as tier:
        assert len(list(tier.items())) == 0
    with Session(SessionConfig.of(nvme_dir=tmp_path, mode="dense"), loaded=lm) as session:
        session.read_ids(ids)                          # with reuse on, blocks stay: the next session finds them
    with Session(SessionConfig.of(nvme_dir=tmp_path, mode="dense"), loaded=lm) as session:
        session.read_ids(ids)
        assert session.document_reused > 0


def test_a_prompt_the_tiers_cannot_hold_fails_and_holds_nothing():
    """Its prefix prefilled part-way, then out of room: what it sealed is let go of, not held for good
    (every later prompt would find the tiers full)."""
    lm = tiny_loaded()
    with Session(SessionConfig.of(nvme_dir=None, mode="dense", gpu_budget="128KiB", cpu_budget="128KiB"),
                 loaded=lm) as session:
        with pytest.raises(BudgetExceeded):
            session.complete(random_ids(3000, 1), max_new_tokens=2)
        assert session.backends["dense"].held_blocks() == 0
        assert session.complete(random_ids(40, 2), max_new_tokens=2).generated_tokens == 2


def test_states_kept_for_later_turns_make_room_for_a_prompt_that_needs_it():
    """Each prompt's prefix state is kept for a turn that may follow; when the next prompt finds no
    room, the kept states go (a cache), not the request."""
    lm = tiny_loaded()
    with Session(SessionConfig.of(nvme_dir=None, mode="dense", gpu_budget="192KiB", cpu_budget="192KiB"),
                 loaded=lm) as session:
        for seed in range(3):
            assert session.complete(random_ids(900, seed), max_new_tokens=2).generated_tokens == 2


def test_an_answer_that_fails_midway_is_not_kept_for_the_next_turn(monkeypatch):
    """A step that raised may have left the state part-way through a token: a next turn built on it
    would attend to that. Only an answer read to its end is kept."""
    lm = tiny_loaded()
    with Session(SessionConfig.of(nvme_dir=None, mode="dense"), loaded=lm) as session:
        kept = len(session._states)
        real, calls = DenseState.step, []

        def failing(self, token):
            calls.append(token)
            if len(calls) == 3:
                raise BudgetExceeded("injected")
            return real(self, token)
        monkeypatch.setattr(DenseState, "step", failing)
        stream = session._respond(random_ids(60, 3), [], Sampling(max_new_tokens=8), True, keep=True, start=0.0)
        with pytest.raises(BudgetExceeded):
            list(stream)
        session.backends["dense"].manager.flush()             # (moves between tiers may still run)
        assert len(session._states) == kept and session.backends["dense"].pinned_blocks() == 0


def test_a_stream_closed_before_its_first_piece_lets_go_of_its_state():
    lm = tiny_loaded()
    with Session(SessionConfig.of(nvme_dir=None, mode="dense"), loaded=lm) as session:
        ids = random_ids(300, 4)
        session.complete(ids, max_new_tokens=2)                     # the prefix state: kept
        held = session.backends["dense"].held_blocks()
        for _ in range(3):
            session.complete(ids, stream=True, max_new_tokens=4).close()
        assert session.backends["dense"].held_blocks() == held


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")     # (an error in __del__)
def test_a_stream_dropped_before_its_first_piece_lets_go_of_its_state():
    lm = tiny_loaded()
    with Session(SessionConfig.of(nvme_dir=None, mode="dense"), loaded=lm) as session:
        ids = random_ids(300, 4)
        session.read_ids(ids)
        held = session.backends["dense"].held_blocks()
        for seed in range(3):          # a question of its own after the document, sealing blocks of its own
            prompt = [*ids, *random_ids(300, 10 + seed)]
            stream = session._respond(prompt, [], Sampling(max_new_tokens=4), True, keep=False, start=0.0)
            assert session.backends["dense"].held_blocks() > held
            del stream
        assert session.backends["dense"].held_blocks() == held
        late = session.complete(ids, stream=True, max_new_tokens=4)
    del late                           # after the session closed: nothing to let go of, and nothing said


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")     # (an error in __del__)
def test_a_session_let_go_of_unclosed_ends_its_threads_and_keeps_its_store(tmp_path):
    import gc
    import threading
    import time
    lm = tiny_loaded()
    before = {t for t in threading.enumerate() if t.name.startswith("tierkv")}
    settings = SessionConfig.of(nvme_dir=tmp_path / "store", mode="dense", gpu_budget="64KiB", cpu_budget="64KiB")
    session = Session(settings, loaded=lm)
    ids = random_ids(700, 3)
    session.read_ids(ids)
    fork = session.fork()
    fork.complete([*ids, 5], max_new_tokens=2)
    del session
    gc.collect()
    assert not fork.closed and fork._opener is not None and not fork._opener.closed    # a fork holds it
    del fork
    gc.collect()
    deadline = time.monotonic() + 10
    while (left := {t for t in threading.enumerate() if t.name.startswith("tierkv")} - before) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, sorted(t.name for t in left)
    with Session(settings, loaded=lm) as again:          # the blocks it stored are found
        again.read_ids(ids)
        assert again.document_reused == 512


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_fork_that_failed_and_a_copy_let_go_of_leave_the_session_s_tiers_open(monkeypatch):
    import copy
    import gc
    lm = tiny_loaded()
    with Session(SessionConfig.of(nvme_dir=None, mode="dense"), loaded=lm) as session:
        ids = random_ids(300, 4)
        session.read_ids(ids)

        def fails(state):
            raise KeyboardInterrupt
        with monkeypatch.context() as patch:
            patch.setattr(type(session.document), "fork", fails)
            with pytest.raises(KeyboardInterrupt):
                session.fork()
        copied = copy.copy(session)
        del copied
        gc.collect()
        assert session.complete([*ids, 5], max_new_tokens=2).generated_tokens == 2


def test_a_stream_read_after_its_session_closed_says_so():
    lm = tiny_loaded()
    with Session(SessionConfig.of(nvme_dir=None, mode="dense"), loaded=lm) as session:
        ids = random_ids(300, 4)
        session.read_ids(ids)
        unread, forked = session.complete(ids, stream=True, max_new_tokens=4), session.fork()
        of_fork = forked.complete(ids, stream=True, max_new_tokens=4)
    with pytest.raises(TierKVError, match="the session is closed"):
        next(unread)
    with pytest.raises(TierKVError, match="the session this one was forked from is closed"):
        next(of_fork)


@pytest.mark.model
def test_a_script_that_exits_with_a_stream_half_read_and_its_session_open_exits(tmp_path):
    """As the interpreter exits, the unfinished stream's cleanup finds the tiers' thread stopped: it
    must not wait for it (it did, for ever)."""
    import subprocess
    import sys
    script = tmp_path / "leave.py"
    script.write_text(
        "import sys\nfrom tierkv import Session\n"
        "s = Session.open('smollm2', gpu_budget='4MiB', cpu_budget='8MiB', nvme_dir=sys.argv[1])\n"
        "s.read('Tom is a cat who lives in a red house by the river. Rex is a dog. ' * 60)\n"
        "st = s.ask('Who is Rex?', stream=True, max_new_tokens=20)\nnext(iter(st))\nprint('leaving', flush=True)\n")
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "leaving" in done.stdout and "Exception ignored" not in done.stderr, done.stderr


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_a_document_whose_read_failed_is_not_asked_about(tmp_path, mode):
    """A second read that fails part-way has let go of the first document: the session then holds
    none, and a prompt over it is computed, not answered from KV that is gone."""
    lm = tiny_loaded()
    settings = dict(nvme_dir=None, mode=mode, chunk_tokens=256, sparse_budget=128, page_tokens=16)
    ids = random_ids(600, 8)
    with Session(SessionConfig.of(**settings), loaded=lm) as fresh:
        expected = fresh.complete([*ids, 5, 6], max_new_tokens=6)
    with Session(SessionConfig.of(**settings), loaded=lm) as session:
        session.read_ids(ids)

        def interrupted(_tokens):
            raise KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            session.read_ids(ids, progress=interrupted)
        assert session.document is None
        with pytest.raises(TierKVError, match="read a document first"):
            session.ask("?")
        again = session.complete([*ids, 5, 6], max_new_tokens=6)
        assert again.tokens == expected.tokens and again.reused_tokens == 0


def test_a_state_released_refuses_to_be_used():
    with Session(SessionConfig.of(nvme_dir=None, mode="dense"), loaded=tiny_loaded()) as session:
        session.read_ids(random_ids(300, 9))
        state = session.document
        state.release()
        for use in (state.fork, lambda: state.extend([1]), lambda: state.step(1)):
            with pytest.raises(TierKVError, match="this dense state was released: its KV is gone"):
                use()
        session.document = None


def test_a_session_that_keeps_no_state_answers_as_one_that_does():
    lm, ids = tiny_loaded(), random_ids(400, 11)
    answers = []
    for kept in (4, 0):
        with Session(SessionConfig.of(nvme_dir=None, mode="dense"), loaded=lm, max_states=kept) as session:
            answers.append([session.complete([*ids, t], max_new_tokens=5).tokens for t in (3, 4)])
            assert len(session._states) == min(kept, 1)
    assert answers[0] == answers[1]


@pytest.mark.parametrize("keywords, message", [(dict(max_states=-1), "max_states=-1: expected an integer >= 0"),
                                               (dict(max_states=1.5), "max_states=1.5"),
                                               (dict(max_prompt_tokens=0), "max_prompt_tokens=0: expected an integer")])
def test_session_limits_out_of_range_are_named(keywords, message):
    with pytest.raises(ConfigError, match=message):
        Session(SessionConfig.of(nvme_dir=None, mode="dense"), loaded=tiny_loaded(), **keywords)


def test_document_ids_are_checked_and_ask_needs_the_text():
    with Session(SessionConfig.of(nvme_dir=None, mode="dense"), loaded=tiny_loaded()) as session:
        for bad, message in (([], "expected a non-empty list of ints"), ([10**9], "not in the model's vocabulary"),
                             ([-1], "not in the model's vocabulary"), ([torch.tensor(3)], "is a Tensor, not an integer"),
                             ("abc", "expected a non-empty list of ints")):
            with pytest.raises(ConfigError, match=message):
                session.read_ids(bad)
        assert session.read_ids(np.arange(1, 40)) == 39           # numpy's integers are ids too
        with pytest.raises(TierKVError, match=r"read as token ids \(read_ids\), and ask\(\) puts a question"):
            session.ask("?")


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_a_request_cancelled_while_its_prompt_is_computed_stops_and_holds_nothing(tmp_path, mode):
    lm = tiny_loaded()
    settings = dict(nvme_dir=tmp_path, mode=mode, chunk_tokens=256, sparse_budget=128, page_tokens=16)
    with Session(SessionConfig.of(**settings), loaded=lm) as session:
        asked = []

        def cancelled() -> bool:
            asked.append(1)
            return len(asked) > 1                       # after the prompt's first chunk
        with pytest.raises(Cancelled):
            session.complete(random_ids(1400, 5), stream=True, max_new_tokens=4, cancelled=cancelled)
        backend = session.backends[mode]
        backend.manager.flush()          # what it computed is still being written to the store (it pins the source)
        assert len(asked) == 2 and backend.held_blocks() == 0 and backend.pinned_blocks() == 0


def test_a_fork_whose_parent_closed_says_so_and_closes_quietly(tmp_path):
    session = Session(SessionConfig.of(nvme_dir=tmp_path, mode="dense"), loaded=tiny_loaded())
    session.read_ids(random_ids(100, 7))
    branch = session.fork()
    session.close()
    with pytest.raises(TierKVError, match="the session this one was forked from is closed"):
        branch.complete(random_ids(110, 7), max_new_tokens=2)
    branch.close()                                  # (its tiers went with the parent's: nothing to let go of)


def test_auto_mode_counts_the_answer_s_tokens_against_the_trained_window(tmp_path):
    """A 480-token prompt fits the tiny model's 512-token window, but not with 64 tokens of answer:
    dense decoding would step past the positions the model knows."""
    lm = tiny_loaded()
    settings = dict(nvme_dir=tmp_path, mode="auto", chunk_tokens=256, sparse_budget=128, page_tokens=16)
    with Session(SessionConfig.of(**settings), loaded=lm) as session:
        session.complete(random_ids(480, 6), max_new_tokens=16)
        assert session.last_mode == "dense"
        session.complete(random_ids(480, 6), max_new_tokens=64)
        assert session.last_mode == "sparse"


def test_past_the_trained_window_a_second_prompt_reuses_the_stored_sparse_index(tmp_path):
    lm = tiny_loaded()
    ids = torch.randint(0, 128, (1400,), generator=torch.Generator().manual_seed(1)).tolist()
    settings = dict(nvme_dir=tmp_path, gpu_budget="1MiB", cpu_budget="2MiB", mode="auto", chunk_tokens=256,
                    sparse_budget=128, page_tokens=16)
    with Session(SessionConfig.of(**settings), loaded=lm) as session:
        session.read_ids(ids)
        first = session.complete([*ids, 5, 6, 7], max_new_tokens=4)
        assert session.last_mode == "sparse" and first.reused_tokens == len(ids)
    with Session(SessionConfig.of(**settings), loaded=lm) as again:        # a new session: found stored
        second = again.complete([*ids, 9, 10], max_new_tokens=4)
        assert second.reused_tokens == len(ids)                   # the stored document; 9 and 10 computed
        third = again.complete([*ids, 5, 6, 7], max_new_tokens=4)
        assert third.tokens == first.tokens                       # no trace of the second prompt


def sparse_layers_of(session: Session) -> list:
    """The layers of the sparse state a session keeps for its document (the prefix of its last prompt)."""
    return next(state for state in session._states if state.mode == "sparse").seq.layers


@pytest.mark.parametrize("store", [False, True])
def test_an_answer_past_the_window_starts_its_sparse_state_from_the_dense_document(tmp_path, store):
    """The 480-token document is read dense; an answer of 64 tokens would pass the 512-token window, so its
    prompt is sparse: the sparse state takes the document's KV from the dense one (post-RoPE keys turned
    back) instead of computing it again, and holds what a sparse prefill computes; stored, a new session
    finds it."""
    lm, ids = tiny_loaded(), random_ids(480, 6)
    settings = dict(mode="auto", chunk_tokens=256, sparse_budget=128, page_tokens=16,
                    **({"nvme_dir": tmp_path / "seeded"} if store else {}))
    with Session(SessionConfig.of(**settings), loaded=lm) as computed:   # nothing dense held: all computed
        alone = computed.complete([*ids, 5, 6, 7], max_new_tokens=64)
        assert alone.mode == "sparse" and alone.reused_tokens == 0
        expected = sparse_layers_of(computed)
        with Session(SessionConfig.of(**{**settings, "nvme_dir": tmp_path / "other"} if store else settings),
                     loaded=lm) as session:
            session.read_ids(ids)
            answer = session.complete([*ids, 5, 6, 7], max_new_tokens=64)
            assert answer.mode == "sparse" and answer.reused_tokens == len(ids)       # read, not computed
            assert answer.tokens == alone.tokens
            for got, want in zip(sparse_layers_of(session), expected, strict=True):
                assert got.length == want.length == len(ids) + 2
                torch.testing.assert_close(got.sink_k, want.sink_k, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(got.win_k.rows(), want.win_k.rows(), atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(got.win_v.rows(), want.win_v.rows())
                torch.testing.assert_close(got.basis.basis.abs(), want.basis.basis.abs(), atol=1e-3, rtol=1e-3)
    if store:
        with Session(SessionConfig.of(**{**settings, "nvme_dir": tmp_path / "other"}), loaded=lm) as again:
            found = again.complete([*ids, 5, 6, 7], max_new_tokens=64)
            assert found.reused_tokens == len(ids) + 2 and found.tokens == alone.tokens


def test_a_dense_document_whose_kv_cannot_be_read_or_is_quantized_is_computed_again_in_sparse(monkeypatch):
    lm, ids = tiny_loaded(), random_ids(480, 6)
    settings = dict(mode="auto", chunk_tokens=256, sparse_budget=128, page_tokens=16)
    with Session(SessionConfig.of(**settings), loaded=lm) as computed:
        alone = computed.complete([*ids, 5, 6, 7], max_new_tokens=64)
    with Session(SessionConfig.of(**settings, kv_dtype="int8"), loaded=lm) as quantized:
        quantized.read_ids(ids)                  # (its blocks hold int8 codes, not the KV a sparse prefill computes)
        assert quantized.complete([*ids, 5, 6, 7], max_new_tokens=64).reused_tokens == 0
    import transformers                          # RoPE scaled by the length: the sparse engine's table is not the run's
    config = transformers.LlamaConfig(**TINY, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                              "factor": 2.0})
    torch.manual_seed(0)
    dynamic = transformers.AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    loaded = LoadedModel(dynamic, None, "tiny-dynamic", model_spec(dynamic))
    with Session(SessionConfig.of(**settings), loaded=loaded) as fresh:
        expected = fresh.complete([*ids, 5, 6, 7], max_new_tokens=64).tokens
    with Session(SessionConfig.of(**settings), loaded=loaded) as session:
        session.read_ids(ids)
        answer = session.complete([*ids, 5, 6, 7], max_new_tokens=64)
        assert answer.reused_tokens == 0 and answer.tokens == expected
    read = TieredSequence.read

    def lost_at_layer_1(seq, layer):
        if layer == 1:
            raise BlockMissing("block lost")
        return read(seq, layer)

    with Session(SessionConfig.of(**settings), loaded=lm) as session:
        session.read_ids(ids)
        monkeypatch.setattr(TieredSequence, "read", lost_at_layer_1)
        answer = session.complete([*ids, 5, 6, 7], max_new_tokens=64)
        assert answer.reused_tokens == 0 and answer.tokens == alone.tokens      # layer 0's seeded KV went too


@pytest.mark.model
def test_speculative_decoding_gives_greedy_decoding_s_tokens(smollm2, tmp_path):
    """Prompt-lookup drafts on a document that repeats itself: the same tokens, fewer passes."""
    with smollm2_session(smollm2, tmp_path, mode="dense") as session:
        session.read(DOC)
        plain = session.ask("Repeat the first sentence of the document.", max_new_tokens=24)
        fast = session.ask("Repeat the first sentence of the document.", max_new_tokens=24, draft_tokens=4)
        assert fast.tokens == plain.tokens and fast.text == plain.text
        assert fast.drafted > 0 and 0 < fast.accepted <= fast.drafted
        assert_only_documents_held(session)
        with pytest.raises(ConfigError, match="temperature 0"):
            session.ask("?", draft_tokens=4, temperature=0.5)


def test_a_store_that_cannot_be_made_is_refused_before_the_model_loads(tmp_path):
    taken = tmp_path / "a-file"
    taken.write_text("not a directory")
    for where, problem in ((taken / "kv", "cannot create the store's directory"),
                           (taken, "exists and is not a directory")):
        config = SessionConfig.of(model=str(tmp_path / "no-such-model.gguf"), nvme_dir=where)
        with pytest.raises(ConfigError, match=f"--nvme-dir {where}: {problem}"):   # not the model's error
            Session(config)
    made = tmp_path / "new" / "kv"
    with pytest.raises(ConfigError, match="no-such-model"):
        Session(SessionConfig.of(model=str(tmp_path / "no-such-model.gguf"), nvme_dir=made))
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700


@pytest.mark.model
def test_a_question_on_a_document_that_lost_a_block_computes_it_again_and_leaks_no_hold(smollm2, tmp_path):
    """A block of the held document dropped (as a scrub drops a damaged one): the fork a question is asked of
    cannot hold it, so it lets go of what it held and finds the document by content, computing the rest;
    the block is stored again and the next question reuses it all."""
    with smollm2_session(smollm2, tmp_path, mode="dense") as session:
        session.read(DOC)
        manager = session.backends["dense"].manager
        manager.flush()
        held = sum(len(layer.blocks) for layer in session.document.seq.layers)
        manager.drop([session.document.seq.layers[10].blocks[1]])
        first = session.ask("Who founded the bakery?", max_new_tokens=4)
        again = session.ask("Who founded the bakery?", max_new_tokens=4)
        assert first.text == again.text and first.reused_tokens < again.reused_tokens
        assert sum(entry.holders for entry in manager.manager.directory) <= held       # no fork's holds left over


def test_a_failure_to_close_after_the_block_raised_does_not_replace_its_error(caplog):
    """A disk full at the last flush failed the close too, and the user was told of that one only (with
    other figures); the block's own error goes on, the close's is logged, and every backend's tiers are
    closed all the same (a flush that failed left them joined, and the backends after it). Alone, a close's
    failure is raised."""
    from tierkv.errors import DiskFullError

    def open_both(session):
        backends = [session.backend("dense"), session.backend("sparse")]
        backends[0].manager.flush = lambda: (_ for _ in ()).throw(DiskFullError("no space left at close"))
        return backends

    with caplog.at_level("WARNING", logger="tierkv.session.session"):
        with pytest.raises(ConfigError, match="the block's own"):
            with Session(SessionConfig.of(nvme_dir=None), loaded=tiny_loaded()) as session:
                backends = open_both(session)
                raise ConfigError("the block's own")
    assert "closing failed too: DiskFullError: no space left at close" in caplog.text
    assert all(backend.manager.closed for backend in backends)
    with pytest.raises(DiskFullError, match="at close"):
        with Session(SessionConfig.of(nvme_dir=None), loaded=tiny_loaded()) as session:
            backends = open_both(session)
    assert all(backend.manager.closed for backend in backends)
