"""Routes of the GNN registry: list the versions and their cards; activate one (admin only).

Two levels: the service-wide registry (what every tenant's plans use; only an admin activates a
version there) and each tenant's own (where its training runs register, activated only when a
version improves the held-out error on the tenant's data; `requests.tenant_registry`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path

from tagplan.errors import SpecError
from tagplan.service.api.deps import AdminDep, PrincipalDep, ServicesDep
from tagplan.service.api.schemas import Error, ModelsOut, ModelVersion
from tagplan.service.requests import gnn_version, tenant_registry
from tagplan.training.registry import PACKAGED_CHECKPOINT, Registry

router = APIRouter(tags=["models"])
_ERRORS: dict[int | str, dict[str, Any]] = {401: {"model": Error}}


def registry(services: ServicesDep) -> Registry:
    """The service's registry, `$TAGPLAN_HOME/registry`."""
    return Registry(services.settings.home / "registry")


def _versions(reg: Registry) -> list[ModelVersion]:
    """The registry's versions with their cards; one pruned between the index read and its card's is left out."""
    active, out = reg.active(), []
    for version in reg.versions():
        try:
            out.append(ModelVersion(version=version, active=version == active, card=reg.card(version)))
        except SpecError:  # pruned by a training run meanwhile (`Registry.prune`)
            continue
    return out


def _listing(reg: Registry, tenant: Registry | None = None) -> ModelsOut:
    active = reg.active()
    default = None if active or not PACKAGED_CHECKPOINT.exists() else f"packaged:{PACKAGED_CHECKPOINT.name}"
    return ModelsOut(active=active, default=default, versions=_versions(reg),
                     tenant_active=tenant.active() if tenant is not None else None,
                     tenant_versions=_versions(tenant) if tenant is not None else [],
                     in_use=gnn_version(tenant if tenant is not None else reg))


@router.get("/v1/models", response_model=ModelsOut, responses=_ERRORS, summary="GNN versions")
def list_models(principal: PrincipalDep, services: ServicesDep) -> ModelsOut:
    """The service's versions with their model cards and the active one, the packaged fallback, and
    the caller's own versions (from its training runs) with the one its plans use."""
    return _listing(registry(services), tenant_registry(services.settings, principal.tenant_id))


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
