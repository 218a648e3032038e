"""`tinker://` path and name properties: round trips, and garbage only ever yields the typed error.

Valid parts are generated from the documented grammar (run `<session>:train:<n>`, kind,
name of letters, digits and `._=+-` starting with a letter or digit), independently of the
parser's regular expressions; anything the parser accepts must be exactly such parts.
"""

import string

from hypothesis import example, given, settings
from hypothesis import strategies as st

from openrl_core.errors import InvalidRequest
from openrl_core.ids import CHECKPOINT_KINDS, TinkerPath, check_checkpoint_name, check_tenant_name

ALNUM = string.ascii_letters + string.digits
NAME_CHARS = set(ALNUM + "._=+-")
SESSION_CHARS = set(ALNUM + "-")
TENANT_CHARS = set(string.ascii_lowercase + string.digits + "-")

sessions = st.text(alphabet="".join(sorted(SESSION_CHARS)), min_size=1, max_size=64)
run_ids = st.builds(lambda s, n: f"{s}:train:{n}", sessions, st.text(alphabet=string.digits, min_size=1, max_size=9))
names = st.builds(
    lambda head, tail: head + tail,
    st.sampled_from(ALNUM),
    st.text(alphabet="".join(sorted(NAME_CHARS)), max_size=127),
)
kinds = st.sampled_from(CHECKPOINT_KINDS)


def well_formed_run(run_id: str) -> bool:
    session, sep, number = run_id.partition(":train:")
    return (
        bool(sep) and 1 <= len(session) <= 64 and set(session) <= SESSION_CHARS
        and 1 <= len(number) <= 9 and set(number) <= set(string.digits)
    )  # fmt: skip


def well_formed_name(name: str) -> bool:
    return 1 <= len(name) <= 128 and name[0] in ALNUM and set(name) <= NAME_CHARS


@settings(max_examples=200)
@given(run_ids, kinds, names)
def test_format_and_parse_round_trip(run_id, kind, name):
    path = TinkerPath(run_id, kind, name)
    assert TinkerPath.parse(str(path)) == path
    assert TinkerPath.from_checkpoint_id(run_id, path.checkpoint_id) == path
    assert str(TinkerPath.parse(str(path))) == str(path)


def mutated_paths():
    """A valid path with a few characters inserted, replaced or dropped anywhere."""

    @st.composite
    def mutate(draw):
        text = str(TinkerPath(draw(run_ids), draw(kinds), draw(names)))
        for _ in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, len(text)))
            op = draw(st.sampled_from(["insert", "replace", "drop"]))
            char = draw(st.one_of(st.sampled_from("/.:\n\r\t\x00 %\\?#"), st.characters()))
            if op == "insert":
                text = text[:at] + char + text[at:]
            elif op == "replace":
                text = text[:at] + char + text[at + 1 :]
            else:
                text = text[:at] + text[at + 1 :]
        return text

    return mutate()


@settings(max_examples=400)
@given(st.one_of(mutated_paths(), st.text(), st.text().map(lambda t: "tinker://" + t)))
@example("tinker://s:train:1/weights/step\n")  # `$` also matches before a final newline
@example("tinker://s:train:1\n/weights/step")
def test_garbage_is_refused_with_the_typed_error_or_parses_to_well_formed_parts(text):
    try:
        path = TinkerPath.parse(text)
    except InvalidRequest:
        return
    assert str(path) == text  # nothing is normalised away: one path, one string
    assert well_formed_run(path.run_id) and path.kind in CHECKPOINT_KINDS and well_formed_name(path.name)


@settings(max_examples=50)
@given(
    st.one_of(
        st.none(), st.integers(), st.floats(), st.binary(), st.lists(st.text()), st.dictionaries(st.text(), st.text())
    )
)
def test_non_strings_are_refused_with_the_typed_error(value):
    try:
        TinkerPath.parse(value)
    except InvalidRequest:
        return
    raise AssertionError(f"{value!r} parsed")


@settings(max_examples=300)
@given(st.one_of(st.text(), names.map(lambda n: n + "\n")))
@example("step\n")
def test_checkpoint_names_are_refused_or_well_formed(text):
    try:
        assert check_checkpoint_name(text) == text
    except InvalidRequest:
        return
    assert well_formed_name(text)


@settings(max_examples=300)
@given(st.one_of(st.text(), st.text(alphabet="abc-09\n", max_size=45)))
@example("alice\n")  # a tenant name names its audit file and its topics
def test_tenant_names_are_refused_or_well_formed(text):
    try:
        assert check_tenant_name(text) == text
    except InvalidRequest:
        return
    assert 1 <= len(text) <= 40 and text[0] != "-" and set(text) <= TENANT_CHARS
