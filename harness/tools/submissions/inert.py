"""A submission's text shown to graders as text: in a spreadsheet, a markdown page, a code excerpt.

File names, failure messages and source lines are the submission's own words. A spreadsheet
runs a cell that starts like a formula (OWASP's CSV injection), and a markdown page renders
links, images, HTML and emphasis: each of these helpers makes such text show as written.
"""

from __future__ import annotations

import re

# OWASP's CSV injection rule: a cell starting with one of these is a formula to Excel, LibreOffice
# and Google Sheets. Prefixing a single quote makes it text; the quote shows, nothing runs.
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_NUMBER = re.compile(r"-?\d+(\.\d+)?")  # "-3" or "-0.5" is a number, not a formula: left as it is
# Markdown's punctuation that could start emphasis, code, a link, an image, a heading, a table cell
# or a strikethrough, each escaped with a backslash; < > & become entities so no tag is HTML.
_MARKDOWN = re.compile(r"([\\`*_\[\]{}#|!~$])")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


def csv_cell(value):
    """VALUE as a spreadsheet shows it without running it: a text cell that starts like a formula
    gets a leading single quote; numbers, and text that is a plain number, stay as they are."""
    if isinstance(value, str) and value.startswith(FORMULA_START) and not _NUMBER.fullmatch(value):
        return "'" + value
    return value


def csv_row(row: dict) -> dict:
    return {k: csv_cell(v) for k, v in row.items()}


def markdown_text(text: str) -> str:
    """TEXT on one line of a markdown page (a table cell, a heading, a list item), shown as written."""
    text = _CONTROL.sub(" ", str(text))
    text = _MARKDOWN.sub(r"\\\1", text)
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def code_block(text: str, language: str = "python") -> str:
    """TEXT as a fenced code block that nothing in it can close: the fence is one backtick longer
    than the longest run of backticks in TEXT (CommonMark), and a code block renders no HTML."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text}\n{fence}"
