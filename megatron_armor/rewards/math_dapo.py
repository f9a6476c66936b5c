"""DAPO's math verifier, the one the ARMOR paper scores with (+1 / -1, armor.md §5).

The last "Answer: X" line within the response's final 300 characters is normalized the way Minerva
(Lewkowycz et al., 2022, appendix D) normalizes final answers and compared with the normalized ground
truth as strings: "0.5" and "\\frac{1}{2}" differ here, unlike under math-verify
(`math_verify_reward`). A response without an Answer line is wrong, whatever it boxed.
"""

from __future__ import annotations

import re

TAIL_CHARS = 300
_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)

# Minerva's normalization tables, applied in this order. Replacements first...
_REPLACEMENTS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
# ...then units, filler words and spacing macros are deleted.
_DELETED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)
# Regex rewrites: keep the first $...$ span, unwrap text / bold / overline / box, expand TeX shorthand.
_REWRITES = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),  # \sqrt2 -> \sqrt{2}
)


def normalize_final_answer(answer: str) -> str:
    """Minerva's normal form of a final answer: the right-hand side of its last "=", without units, spaces,
    dollar signs or \\text / \\boxed wrappers, TeX shorthand expanded, and thousands separators dropped
    from integers ("1,000" -> "1000")."""
    answer = answer.split("=")[-1]
    for old, new in _REPLACEMENTS:
        answer = answer.replace(old, new)
    for expression in _DELETED:
        answer = answer.replace(expression, "")
    for pattern, replacement in _REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def extract_answer(response: str) -> str | None:
    """The text after the last "Answer:" (any case) in the final `TAIL_CHARS` characters, or None."""
    matches = _ANSWER_LINE.findall(response[-TAIL_CHARS:])
    return matches[-1] if matches else None


def verify(response: str, row: dict) -> tuple[float, bool]:
    """(+1, True) if the response's last Answer line normalizes to row["answer"] normalized, else (-1, False)."""
    answer = extract_answer(response)
    correct = answer is not None and normalize_final_answer(answer) == normalize_final_answer(str(row["answer"]))
    return (1.0, True) if correct else (-1.0, False)
