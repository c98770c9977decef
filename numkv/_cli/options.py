"""Option types of the command line (argparse ``type=``): every value is
checked when the command line is parsed, so a bad one is a one-line usage
error (exit status 2) before any work is done.  A leaf: imports no command."""

import argparse
import os

# Thread and process counts beyond this are typing mistakes, not machines: a
# pool of a million threads would be started before anything could fail.
MAX_WORKERS = 1024


def count(minimum=1, maximum=None):
    """An argparse ``type``: an integer in ``[minimum, maximum]``."""
    def parse(text):
        try:
            value = int(text, 10)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {text!r}")
        return value

    parse.__name__ = "count"
    return parse


def regex(text):
    """An argparse ``type``: a regular expression Python can compile."""
    import re

    try:
        re.compile(text)
    except (re.error, RecursionError, OverflowError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression ({exc})") from None
    return text


# What matplotlib's savefig writes without extra software (pgf needs LaTeX).
IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".svgz", ".eps", ".ps", ".jpg", ".jpeg", ".tif", ".tiff", ".webp")


def image_path(text):
    """An argparse ``type``: a file to write an image to, in a folder that
    exists and this user may write to, with a suffix matplotlib can draw
    (none: PNG)."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a file name")
    suffix = os.path.splitext(text)[1].lower()
    if suffix and suffix not in IMAGE_SUFFIXES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: cannot draw a {suffix} file (one of {', '.join(IMAGE_SUFFIXES)})")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r}: cannot write there (permission)")
    return text
