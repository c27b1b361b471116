"""Multipart forms read strictly: a text field that is not UTF-8 and a form over its limits are refused with
the field named (422), where Starlette's ``request.form()`` decodes such a field as Latin-1 (so a dataset's
name with invalid UTF-8 was stored as mojibake) and answers its limits with a bare 400."""

from __future__ import annotations

from contextlib import aclosing

from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from api.errors import InvalidRequest


class NotUtf8(MultiPartException):
    def __init__(self, field: str) -> None:
        super().__init__(f"{field}: not valid UTF-8")
        self.field = field


class _StrictMultiPartParser(MultiPartParser):
    """Starlette's parser, except that a text field must decode as the form's charset (UTF-8 unless the
    request names another)."""

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None:
            try:
                bytes(part.data).decode(self._charset or "utf-8")
            except (UnicodeDecodeError, LookupError):
                raise NotUtf8(part.field_name) from None
        super().on_part_end()


async def read_form(request: Request, *, max_files: int, max_fields: int) -> FormData:
    """The request's multipart form (the caller closes it: ``await form.close()``).

    Raises:
        InvalidRequest: a text field that is not UTF-8 (naming it), or a form Starlette's parser refuses
            (more parts than allowed, a malformed body), naming ``body``.
    """
    try:
        async with aclosing(request.stream()) as stream:
            parser = _StrictMultiPartParser(
                request.headers, stream, max_files=max_files, max_fields=max_fields
            )
            return await parser.parse()
    except NotUtf8 as exc:
        raise InvalidRequest(exc.message, field=exc.field) from None
    except MultiPartException as exc:
        raise InvalidRequest(f"multipart body: {exc.message}", field="body") from None
