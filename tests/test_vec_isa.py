"""Inductor's vector-ISA probe once per machine (``runtime/vec_isa.py``): a process without the machine's record
probes and records a pass; one with it takes the ISA as checked and compiles no test program; a failed probe is
not recorded."""

from __future__ import annotations

import json

import pytest
from torch._inductor import cpu_vec_isa

from dflash_compile.runtime import vec_isa


@pytest.fixture
def fresh_probe(tmp_path, monkeypatch):
    """This process as if it had never probed, the machine's record under ``tmp_path``; the probes counted."""
    probes = []  # the probes of an ISA itself (not the extra checks some ISAs make: AVX-512 BF16, VNNI, AMX)
    check_build = cpu_vec_isa.VecISA.check_build

    def counted(self, code):
        if code == cpu_vec_isa.VecISA._avx_code:
            probes.append(str(self))
        return check_build(self, code)

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", counted)
    monkeypatch.setattr(vec_isa, "machine_record", lambda: tmp_path / "record.json")

    def forget():  # Inductor's per-process memos of the probe
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
        for isa in cpu_vec_isa.supported_vec_isa_list:
            for cls in type(isa).__mro__:
                for name in ("__bool__", "_VecISA__bool__impl"):
                    if hasattr(vars(cls).get(name), "cache_clear"):
                        vars(cls)[name].cache_clear()

    forget()
    yield probes, forget, tmp_path / "record.json"
    forget()  # the next test probes for real again


def test_the_probe_runs_once_per_machine(fresh_probe):
    probes, forget, record = fresh_probe
    isa = vec_isa.probe()
    if not isa:
        pytest.skip("Inductor finds no vector ISA it can build on this machine: nothing is recorded")
    assert probes and json.loads(record.read_text())["isa"] == isa
    forget()  # another process on the same machine
    probes.clear()
    assert vec_isa.passed_here()
    assert vec_isa.probe() == isa and vec_isa.picked() == isa
    assert probes == []  # no test program compiled or loaded
    with vec_isa.trusted():
        assert bool(cpu_vec_isa.pick_vec_isa())
    assert probes == []


def test_a_failed_probe_is_not_recorded(fresh_probe, monkeypatch):
    probes, forget, record = fresh_probe
    def failing(self, code):
        probes.append(str(self))
        return False

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", failing)
    assert vec_isa.probe() == ""
    assert probes and not record.exists() and not vec_isa.passed_here()
    with vec_isa.trusted():  # nothing to trust: Inductor's own answer stands
        assert not cpu_vec_isa.pick_vec_isa()


def test_a_damaged_record_is_no_pass(fresh_probe):
    _, _, record = fresh_probe
    record.write_text("{not json")
    assert not vec_isa.passed_here()
