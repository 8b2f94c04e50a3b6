import pytest

from dynamod.core.template import TemplateError, render

CTX = {"ports": {"client": 2379}, "units": {"etcd": {"ports": {"client": 1}}},
       "vars": {"n": 2, "flag": True}, "index": 0}


def test_references_render() -> None:
    assert render("http://127.0.0.1:{ports.client}", CTX) == "http://127.0.0.1:2379"
    assert render("{units.etcd.ports.client}/{vars.n}/{index}", CTX) == "1/2/0"
    assert render("{vars.flag}", CTX) == "true"


def test_braces_escape() -> None:
    assert render('["{{generate}}"]', CTX) == '["{generate}"]'


def test_unknown_reference_names_what_is_known() -> None:
    with pytest.raises(TemplateError) as info:
        render("{ports.clinet}", CTX)
    assert "{ports.clinet}" in str(info.value) and "ports.client" in str(info.value)


def test_reference_to_a_table_is_an_error() -> None:
    with pytest.raises(TemplateError):
        render("{ports}", CTX)
