"""Math answers compared as math: the `math` scorer for GSM8K- and MATH-style rows.

    math_score(solution_str, ground_truth) -> {"score": 0/1, "acc": 0/1, "pred": answer | None, "timeout": 0/1}

1. **Extract** the response's answer: the last ``\\boxed{...}`` (or ``\\fbox``; braces balanced), else
   the number after the last ``####``, else the last number in the text.
2. **Normalise** both sides (`normalize`): ``$``, ``\\left``/``\\right``, spacing commands,
   ``\\dfrac``/``\\tfrac``, ``\\text{...}`` units, degrees, thousands separators (``1,000``),
   a leading ``x =``, a trailing period; a ``%`` is remembered (a percentage equals both its number
   and its fraction: ``50\\%`` matches ``50`` and ``0.5``).
3. **Compare**: equal strings, or equal numbers (relative 1e-9), answer in microseconds on the
   driver; otherwise symbolically with the `math-verify` package (LaTeX -> sympy, then equality of
   expressions, intervals, sets, tuples) in a helper process with a time limit per comparison: a
   pathological expression (``9^{9^{9^9}}``) is killed with its process and scores 0
   (``timeout`` = 1). math-verify's own time limits use SIGALRM, which only the main thread may
   set; the reward runs in the driver's stage threads, so the limit here is the process's.

`pred` is what validation's maj@N votes on.
"""

from __future__ import annotations

import atexit
import json
import re
import select
import subprocess
import sys
import threading

DEFAULT_TIMEOUT_S = 5.0

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_GSM8K_MARK = re.compile(r"####\s*\$?\s*([^\n]*)")


def math_score(solution_str: str, ground_truth, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """1.0 when the response's answer equals `ground_truth` as math, else 0.0 (see the module doc)."""
    pred = extract_answer(solution_str or "")
    if pred is None:
        return {"score": 0.0, "acc": 0.0, "pred": None, "timeout": 0.0}
    try:
        same = is_equiv(pred, str(ground_truth), timeout_s)
        timed_out = False
    except MathTimeout:
        same, timed_out = False, True
    score = 1.0 if same else 0.0
    return {"score": score, "acc": score, "pred": normalize(pred), "timeout": float(timed_out)}


# ---------------------------------------------------------------------------------- extraction
def extract_answer(text: str) -> str | None:
    """The last ``\\boxed{...}``'s content, else the text after the last ``####``, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    marks = _GSM8K_MARK.findall(text)
    if marks and marks[-1].strip():
        return marks[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces balanced), or of
    ``\\boxed 5``; None when there is none or its braces never close."""
    start, token = max((text.rfind(t), t) for t in ("\\boxed", "\\fbox"))
    if start < 0:
        return None
    rest = text[start + len(token):]
    if rest.startswith(" "):  # \boxed 5
        return rest.strip().split("$")[0].split()[0] if rest.strip() else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return rest[1:i].strip()
    return None


# ---------------------------------------------------------------------------------- normalisation
_UNIT_TEXT = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{\s*([^{}]*)\}")
_THOUSANDS = re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+)(?![\d,]*\.?\d*,\d)")
_TRAILING_UNITS = re.compile(r"^(-?[\d.]+)\s+[a-zA-Z]+(?:\s+[a-zA-Z]+)*$")  # "5 cm", "12 dollars"
_ASSIGNMENT = re.compile(r"^[a-zA-Z]\s*=\s*(?!=)")


def normalize(s: str) -> str:
    """A canonical string for an answer (see the module doc); a ``%`` is kept as a trailing ``%``."""
    s = str(s).strip()
    for old, new in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""), ("\\!", ""),
                     ("\\,", ""), ("\\;", ""), ("\\:", ""), ("\\ ", ""), ("\\$", ""), ("$", ""), ("^{\\circ}", ""),
                     ("^\\circ", ""), ("°", ""), ("\\%", "%"), ("\\displaystyle", "")):
        s = s.replace(old, new)
    # \text{ cm} after a number is a unit; \text{yes} alone is the answer.
    inner = _UNIT_TEXT.sub(lambda m: m.group(1), s)
    stripped_units = _UNIT_TEXT.sub("", s).strip()
    s = stripped_units if stripped_units and _NUMBER.fullmatch(stripped_units.replace(" ", "")) else inner
    s = _ASSIGNMENT.sub("", s.strip())
    s = _THOUSANDS.sub(lambda m: m.group(1).replace(",", ""), s)
    m = _TRAILING_UNITS.match(s)
    if m:
        s = m.group(1)
    s = s.strip().rstrip(".").strip()
    s = re.sub(r"\s+", " ", s)
    if s.startswith("+"):
        s = s[1:]
    return s


# ---------------------------------------------------------------------------------- comparison
def is_equiv(pred: str, truth: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """pred and truth equal as strings, as numbers, or (math-verify) as expressions; MathTimeout
    when the symbolic comparison runs past timeout_s."""
    a, b = normalize(pred), normalize(truth)
    a_forms, b_forms = _percent_forms(a), _percent_forms(b)
    if any(x == y for x in a_forms for y in b_forms):
        return True
    na, nb = [_as_number(x) for x in a_forms], [_as_number(y) for y in b_forms]
    if all(v is not None for v in na + nb):  # plain numbers: no need for sympy
        return any(_close(x, y) for x in na for y in nb)
    return any(_VERIFIER.equal(y, x, timeout_s) for x in a_forms for y in b_forms)


def _percent_forms(s: str) -> list[str]:
    """[s] or, for a percentage, [its number, its fraction]: 50% -> ["50", "0.5"]."""
    if not s.endswith("%"):
        return [s]
    body = s[:-1].strip()
    value = _as_number(body)
    return [body] + ([repr(value / 100)] if value is not None else [f"({body})/100"])


def _as_number(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def _close(x: float, y: float) -> bool:
    return x == y or abs(x - y) <= 1e-9 * max(abs(x), abs(y))


class MathTimeout(Exception):
    """A symbolic comparison ran past its time limit."""


class _Verifier:
    """math-verify in a helper process (`python -m hybridflow.rewards.math`), one JSON line per
    comparison; killed and restarted when one runs past its limit. Thread-safe."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        atexit.register(self.close)

    def equal(self, truth: str, pred: str, timeout_s: float) -> bool:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = subprocess.Popen([sys.executable, "-m", "hybridflow.rewards.math"], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, text=True, bufsize=1)
                timeout_s += 30.0  # the first call also imports sympy and math-verify
            self._proc.stdin.write(json.dumps([truth, pred]) + "\n")
            self._proc.stdin.flush()
            ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
            if not ready:
                self.close()
                raise MathTimeout(f"comparing {pred[:80]!r} with {truth[:80]!r} took longer than {timeout_s} s")
            line = self._proc.stdout.readline()
            if not line:  # the helper died (e.g. out of memory): the answer does not count
                self.close()
                return False
            return line.strip() == "1"

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


_VERIFIER = _Verifier()


def _serve() -> None:
    """The helper process: read [truth, pred] lines, answer 1 / 0."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its note that the time limit is ours
    for line in sys.stdin:
        truth, pred = json.loads(line)
        try:
            ok = verify(parse(f"${truth}$", parsing_timeout=None), parse(f"${pred}$", parsing_timeout=None), timeout_seconds=None)
        except Exception:  # noqa: BLE001 - an unparsable answer is a wrong one
            ok = False
        sys.stdout.write("1\n" if ok else "0\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
