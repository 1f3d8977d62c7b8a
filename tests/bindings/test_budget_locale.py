"""The C budget parsers ignore the process's locale (core/prazo_budget.h).

An app may call ``locale.setlocale(locale.LC_ALL, "")`` under a German or
French environment; C's ``strtod`` then reads "1.5" as 1, and a client's
1.5 ms budget would become 1 ms. Here a comma-decimal locale is in force in a
fresh interpreter (a locale is process-wide) and the C parsers must still read
the decimal point.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from _required import require_compiled

COMMA_LOCALE = "de_DE.UTF-8"

CHILD = textwrap.dedent(
    """
    import ctypes, locale, sys
    from prazo.bindings.servers.frontdoor import _engine_c as engine

    locale.setlocale(locale.LC_ALL, sys.argv[1])
    assert locale.localeconv()["decimal_point"] == ",", locale.localeconv()["decimal_point"]
    libc = ctypes.CDLL(None)
    libc.strtod.restype = ctypes.c_double
    # The premise: under this locale the C library's own strtod stops at the '.'.
    assert libc.strtod(b"1.5", None) == 1.0, libc.strtod(b"1.5", None)
    assert engine.parse_budget_ms(b"1.5") == 1.5
    assert engine.parse_budget_ms(b" 0.25 ") == 0.25
    assert engine.parse_budget_ms(b"1,5") is None
    assert engine.incoming_budget([(b"X-Request-Budget-Ms", b"1.5")]) == (1.5, 0, "X-Request-Budget-Ms")
    assert engine.deadline_ns_for([(b"X-Request-Budget-Ms", b"1.5")], 0, 1000.0, 30000.0) == 1_500_000
    assert engine.parse_envoy_timeout_ms(b"250") == 250.0
    print("ok")
    """
)


def _comma_locale_env(tmp_path):
    """The environment under which COMMA_LOCALE loads: installed, or compiled here with localedef."""
    installed = {name.lower().replace("utf8", "utf-8") for name in _installed_locales()}
    if COMMA_LOCALE.lower() in installed:
        return dict(os.environ)
    if shutil.which("localedef") is None or not glob.glob("/usr/share/i18n/locales/de_DE"):
        pytest.skip(f"no {COMMA_LOCALE} locale, and no localedef with its sources to make one")
    subprocess.run(
        ["localedef", "-i", "de_DE", "-f", "UTF-8", str(tmp_path / COMMA_LOCALE)],
        check=True,
        capture_output=True,
    )
    return {**os.environ, "LOCPATH": str(tmp_path)}


def _installed_locales():
    try:
        return subprocess.run(["locale", "-a"], check=True, capture_output=True, text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return []


def test_a_decimal_budget_means_the_same_under_a_comma_decimal_locale(tmp_path):
    require_compiled("prazo.bindings.servers.frontdoor._engine_c")
    env = _comma_locale_env(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, COMMA_LOCALE], check=False, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
