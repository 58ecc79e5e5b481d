"""vLLM's runtime LoRA routes, mounted with ``--enable-lora`` (simulated adapters: app/lora.py).

- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``: 200 ``Success: LoRA adapter
  'NAME' added successfully.``; 400 for a name already loaded or past ``--max-cpu-loras``; 404
  when nothing exists at the path (vLLM's "No adapter found").
- ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: 200 ``Success: LoRA adapter 'NAME' removed
  successfully.`` (also while requests still use it: they finish); 404 for an unknown name.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from app.api.deps import ServingDep
from app.api.errors import APIError
from app.api.schemas import Text
from app.lora import LoRAError

router = APIRouter(prefix="/v1", tags=["LoRA adapters"])

STATUS = {"not_found": (404, "not_found_error"), "duplicate": (400, "invalid_request_error"),
          "too_many": (400, "invalid_request_error")}  # fmt: skip


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: Text = Field(min_length=1, max_length=256)
    lora_path: Text = Field(min_length=1)
    load_inplace: bool = False  # vLLM's field; an adapter here has no weights to replace


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: Text = Field(min_length=1, max_length=256)
    lora_int_id: StrictInt | None = None  # vLLM's field; the name decides


def _refused(err: LoRAError, param: str) -> APIError:
    status, kind = STATUS[err.kind]
    code = {"not_found": "lora_not_found", "duplicate": "lora_already_loaded",
            "too_many": "too_many_loras"}[err.kind]  # fmt: skip
    return APIError(status, str(err), kind, param=param, code=code)


@router.post("/load_lora_adapter", response_class=PlainTextResponse,
             responses={400: {"description": "a duplicate name, or past --max-cpu-loras"},
                        404: {"description": "no adapter at the path"}})  # fmt: skip
async def load_lora_adapter(body: LoadLoRAAdapterRequest, serving: ServingDep) -> str:
    try:
        serving.loras.load(body.lora_name, body.lora_path)
    except LoRAError as err:
        raise _refused(err, "lora_path" if err.kind == "not_found" else "lora_name") from None
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/unload_lora_adapter", response_class=PlainTextResponse,
             responses={404: {"description": "no adapter of that name"}})  # fmt: skip
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, serving: ServingDep) -> str:
    try:
        serving.loras.unload(body.lora_name)
    except LoRAError as err:
        raise _refused(err, "lora_name") from None
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
