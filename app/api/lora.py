"""vLLM's runtime LoRA routes, mounted with ``--enable-lora`` (simulated adapters: app/lora.py).

- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``: 200 ``Success: LoRA adapter
  'NAME' added successfully.``; 400 for a name that is not an adapter name, a name already
  loaded, past ``--max-cpu-loras``, or a path no adapter loads from (one answer, param
  ``lora_path``, whatever the reason: see app/lora.py).
- ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: 200 ``Success: LoRA adapter 'NAME' removed
  successfully.`` (also while requests still use it: they finish); 404 for an unknown name.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from app.api.deps import ServingDep
from app.api.errors import APIError, InvalidField, NotFound, documented
from app.api.schemas import Text
from app.lora import LoRAError

router = APIRouter(prefix="/v1", tags=["LoRA adapters"])

CODES = {"not_found": "lora_not_found", "not_loadable": "invalid_lora_path",
         "invalid_name": "invalid_lora_name", "duplicate": "lora_already_loaded",
         "too_many": "too_many_loras"}  # fmt: skip


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: Text = Field(min_length=1, max_length=256)
    lora_path: Text = Field(min_length=1)  # (a longer path than app.lora.MAX_PATH: not loadable)
    load_inplace: bool = False  # vLLM's field; an adapter here has no weights to replace


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: Text = Field(min_length=1, max_length=256)
    lora_int_id: StrictInt | None = None  # vLLM's field; the name decides


def _refused(err: LoRAError, param: str) -> APIError:
    if err.kind == "not_found":
        return NotFound(str(err), param=param, code=CODES[err.kind])
    return InvalidField(str(err), param=param, code=CODES[err.kind])


LOAD_ERRORS = documented(
    (InvalidField, "a bad or duplicate name, past --max-cpu-loras, or no adapter loads from it")
)


@router.post("/load_lora_adapter", response_class=PlainTextResponse, responses=LOAD_ERRORS)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, serving: ServingDep) -> str:
    try:
        serving.loras.load(body.lora_name, body.lora_path)
    except LoRAError as err:
        raise _refused(err, "lora_path" if err.kind == "not_loadable" else "lora_name") from None
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/unload_lora_adapter", response_class=PlainTextResponse,
             responses=documented((NotFound, "no adapter of that name")))  # fmt: skip
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, serving: ServingDep) -> str:
    try:
        serving.loras.unload(body.lora_name)
    except LoRAError as err:
        raise _refused(err, "lora_name") from None
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
