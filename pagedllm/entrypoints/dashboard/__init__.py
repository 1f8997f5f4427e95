"""The operator's dashboard served by `pagedllm serve` at `/dashboard` (state.py: the data;
routes.py: the routes and the API-key scheme; static/: the page, shipped in the package)."""

from pagedllm.entrypoints.dashboard.routes import register_dashboard_routes
from pagedllm.entrypoints.dashboard.state import Dashboard, DashboardStatLogger

__all__ = ["Dashboard", "DashboardStatLogger", "register_dashboard_routes"]
