"""A chat template comes with a checkpoint, and Jinja is a programming language: a template that
loops for ever or builds a gigantic value fails at once with a `ChatTemplateError` naming the
template's file and the bound it passed, instead of hanging the run or filling its memory.

Each template goes in through the folder a run loads (``tokenizer_config.json`` or
``chat_template.jinja``) and renders through `Tokenizer.render_chat`, as in a rollout.
"""

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from jax_agent_rl.tokenization import ChatTemplateError, Tokenizer, save_tokenizer, train_bpe
from tests.tokenization.test_tokenizer import CORPUS

# A regression fails on the timeout (a Jinja loop is Python, so the alarm stops it) or on its
# error; each attack below fails in well under a second.
pytestmark = pytest.mark.timeout(60)

STEPS = r"takes more than \d+ steps"
CHARS = r"of more than \d+ characters or items"
NUMBER = r"the number \d+, over the bound of \d+"
BIG = "{% set s = 'x' * 10000000 %}"  # 10 M characters, under the bound on a value

ATTACKS = {
    # work
    "nested-range": (
        "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
        STEPS,
    ),
    "nested-range-writing": (
        "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}",
        STEPS,
    ),
    "macro-fan-out": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        "{{ f(60) }}",
        STEPS,
    ),
    "scan-big-string": (BIG + "{% for i in range(99999) %}{{ 'y' in s }}{% endfor %}", STEPS),
    "method-on-big-string": (
        BIG + "{% for i in range(99999) %}{{ s.count('y') }}{% endfor %}",
        STEPS,
    ),
    "slice-big-string": (BIG + "{% for i in range(99999) %}{% set t = s[1:] %}{% endfor %}", STEPS),
    "shared-list-doubling": (
        "{% set ns = namespace(x=[1]) %}{% for i in range(80) %}{% set ns.x = [ns.x, ns.x] %}"
        "{% endfor %}{{ ns.x }}",
        STEPS,
    ),
    "shared-dict-doubling": (
        "{% set ns = namespace(x=1) %}{% for i in range(80) %}"
        "{% set ns.x = {'a': ns.x, 'b': ns.x} %}{% endfor %}{{ ns.x | tojson }}",
        STEPS,
    ),
    "namespace-doubling": (
        "{% set ns = namespace(x=1) %}{% for i in range(80) %}"
        "{% set ns.x = namespace(a=ns.x, b=ns.x) %}{% endfor %}{{ ns }}",
        STEPS,
    ),
    # size
    "repeat-string": ("{{ 'x' * 10**10 }}", CHARS),
    "repeat-string-at-the-bound": ("{{ 'x' * (2**24 + 1) }}", CHARS),
    "repeat-list": ("{{ ([0] * 10**10) | length }}", CHARS),
    "concat": (BIG + "{{ s ~ s }}", CHARS),
    "concat-doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s | length }}",
        f"{STEPS}|{CHARS}",
    ),
    "indent-many-lines": ("{{ ('a\\n' * 1000) | indent(10**7) }}", CHARS),
    "indent-width": ("{{ 'a' | indent(10**10) }}", NUMBER),
    "replace-filter": ("{{ ('x' * 100000) | replace('x', 'y' * 100000) }}", CHARS),
    "replace-method": ("{{ ('x' * 100000).replace('x', 'y' * 100000) }}", CHARS),
    "join-filter": ("{{ ('x' * 100000) | join('y' * 100000) }}", CHARS),
    "join-method": ("{{ ('y' * 100000).join('x' * 100000) }}", CHARS),
    "wordwrap": ("{{ ('x ' * 100000) | wordwrap(1, wrapstring='y' * 100000) }}", CHARS),
    "center": ("{{ 'x'.center(10**10) }}", NUMBER),
    "format-width": ("{{ '{:>999999999}'.format(1) }}", NUMBER),
    "percent-width": ("{{ '%0999999999d' % 1 }}", NUMBER),
    "tojson-indent": (
        "{{ {'a': {'b': [1, 2]}} | tojson(indent=10**7) }}",
        r"tojson\(indent=10000000\), over the bound of \d+",
    ),
    "lipsum": ("{{ lipsum(n=10**6, max=10**6) }}", CHARS),
    "huge-integer": ("{{ 2 ** 10000000 }}", r"an integer of over \d+ bits"),
    # nesting
    "deep-expression": ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "does not compile"),
}

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tok"), train_bpe(CORPUS, 300), None)


def _folder(tokenizer_files: Path, tmp_path: Path, template: str, where: str) -> Path:
    """A tokenizer folder with ``template`` in ``where``; returns the file that names it."""
    folder = Path(shutil.copytree(tokenizer_files, tmp_path / "tok"))
    config = folder / "tokenizer_config.json"
    if where == "tokenizer_config.json":
        config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": template}))
        return config
    (folder / "chat_template.jinja").write_text(template)
    return folder / "chat_template.jinja"


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_hostile_templates_fail_fast(
    tokenizer_files: Path, tmp_path: Path, attack: str, where: str
) -> None:
    template, bound = ATTACKS[attack]
    file = _folder(tokenizer_files, tmp_path, template, where)
    tokenizer = Tokenizer.from_pretrained(file.parent)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        tokenizer.render_chat(MESSAGES)
    assert time.monotonic() - start < 10
    assert e.type is ChatTemplateError
    assert str(file) in str(e.value)
    assert re.search(bound, str(e.value)), str(e.value)


def test_a_real_template_renders_within_the_bounds(tokenizer_files: Path, tmp_path: Path) -> None:
    """The bounds leave room: a loop of 10 000 steps writing 10 M characters renders."""
    template = BIG + "{% for i in range(10000) %}{{ i }}{% endfor %}{{ s }}"
    file = _folder(tokenizer_files, tmp_path, template, "chat_template.jinja")
    text = Tokenizer.from_pretrained(file.parent).render_chat(MESSAGES)
    assert text.endswith("9999" + "x" * 10_000_000)
