"""Routes of the GNN registry: list the versions and their cards; activate one (admin only)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path

from tagplan.errors import SpecError
from tagplan.service.api.deps import AdminDep, PrincipalDep, ServicesDep
from tagplan.service.api.schemas import Error, ModelsOut, ModelVersion
from tagplan.training.registry import PACKAGED_CHECKPOINT, Registry

router = APIRouter(tags=["models"])
_ERRORS: dict[int | str, dict[str, Any]] = {401: {"model": Error}}


def registry(services: ServicesDep) -> Registry:
    """The service's registry, `$TAGPLAN_HOME/registry`."""
    return Registry(services.settings.home / "registry")


def _listing(reg: Registry) -> ModelsOut:
    active = reg.active()
    versions = [ModelVersion(version=v, active=v == active, card=reg.card(v)) for v in reg.versions()]
    default = None if active or not PACKAGED_CHECKPOINT.exists() else f"packaged:{PACKAGED_CHECKPOINT.name}"
    return ModelsOut(active=active, default=default, versions=versions)


@router.get("/v1/models", response_model=ModelsOut, responses=_ERRORS, summary="GNN versions")
def list_models(_: PrincipalDep, services: ServicesDep) -> ModelsOut:
    """The registry's versions with their model cards, the active one, and the packaged fallback."""
    return _listing(registry(services))


@router.post("/v1/models/{version}/activate", response_model=ModelsOut,
             responses={**_ERRORS, 403: {"model": Error}, 404: {"model": Error}}, summary="Activate a GNN version")
def activate_model(version: Annotated[str, Path(max_length=64, description="a version, e.g. v0002")],
                   _: AdminDep, services: ServicesDep) -> ModelsOut:
    """Make `version` the one plans use (admin keys only); the registry afterwards."""
    reg = registry(services)
    try:
        reg.activate(version)
    except SpecError as err:
        raise HTTPException(404, str(err)) from None
    return _listing(reg)
