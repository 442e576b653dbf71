"""KernelSwitch: the environment-or-override choice behind the attention forward and backward
switches."""

import pytest

from vexact_models.kernels.kernel_switch import KernelSwitch


def test_a_default_outside_the_modes_is_refused():
    with pytest.raises(ValueError, match="default 'c' is not one of"):
        KernelSwitch("X_SWITCH", ("a", "b"), "c", "thing")


def test_environment_override_and_restore(monkeypatch):
    switch = KernelSwitch("X_SWITCH", ("a", "b"), "a", "thing")
    monkeypatch.delenv("X_SWITCH", raising=False)
    assert switch.mode() == "a"
    monkeypatch.setenv("X_SWITCH", "b")
    assert switch.mode() == "b"
    with switch.use("a"):  # the override wins over the environment
        assert switch.mode() == "a"
        with switch.use(None):  # None hands the choice back to the environment
            assert switch.mode() == "b"
        assert switch.mode() == "a"
    assert switch.mode() == "b"
    switch.set("a")
    assert switch.mode() == "a"
    switch.set(None)
    assert switch.mode() == "b"


def test_bad_values_name_their_source_and_change_nothing(monkeypatch):
    switch = KernelSwitch("X_SWITCH", ("a", "b"), "a", "thing")
    monkeypatch.setenv("X_SWITCH", "z")
    with pytest.raises(ValueError, match=r"X_SWITCH='z' is not a thing; choose one of \('a', 'b'\)"):
        switch.mode()
    with switch.use("b"):
        with pytest.raises(ValueError, match="thing='B'"):
            switch.set("B")
        assert switch.mode() == "b"
    with pytest.raises(ValueError, match="thing='q'"), switch.use("q"):
        pass


def test_a_switch_records_its_module_and_one_variable_has_one_declaration():
    switch = KernelSwitch("X_RECORDED", ("a", "b"), "a", "thing")
    assert switch.module == __name__ and switch in KernelSwitch.declared()
    assert KernelSwitch("X_RECORDED", ("a", "b"), "b", "thing") in KernelSwitch.declared()  # re-imported: replaced
    with pytest.raises(ValueError, match="X_RECORDED is declared in .* already; elsewhere declares it again"):
        KernelSwitch("X_RECORDED", ("a", "b"), "a", "thing", module="elsewhere")
    names = [s.env_var for s in KernelSwitch.declared()]
    assert names == sorted(names) and names.count("X_RECORDED") == 1
