"""`decoderlm generate --json-schema / --grammar` on the embedded SmolLM2."""

from __future__ import annotations

import json

import jsonschema
import pytest

import decoderlm.cli as cli

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPT = "A person as JSON:"


def test_generate_json_schema_output_validates(tmp_path, capsys):
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    for seed in (0, 1):
        argv = ["generate", "--prompt", PROMPT, "--json-schema", str(tmp_path / "schema.json"), "--temperature", "1",
                "--seed", str(seed), "--max-new-tokens", "40"]
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith(PROMPT)
        jsonschema.validate(json.loads(out[len(PROMPT):]), SCHEMA)


def test_generate_lark_grammar(tmp_path, capsys):
    (tmp_path / "g.lark").write_text('start: "yes" | "no"\n')
    assert cli.main(["generate", "--prompt", "Is the sky green? Answer: ", "--grammar", str(tmp_path / "g.lark"), "--seed", "0"]) == 0
    assert capsys.readouterr().out.split("Answer: ", 1)[1] in ("yes\n", "no\n")


@pytest.mark.parametrize("content, extra, message", [
    ('{"type": "array", "uniqueItems": true}', [], "keyword(s) uniqueItems cannot be enforced"),
    ('{"type": ', [], "not JSON"),
    (None, [], "cannot read it"),
    (json.dumps(SCHEMA), ["--prompt-lookup"], "cannot be combined with --draft-model or --prompt-lookup"),
])
def test_generate_json_schema_refusals_are_one_line(tmp_path, capsys, content, extra, message):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    assert cli.main(["generate", "--prompt", "x", "--json-schema", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1

