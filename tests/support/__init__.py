"""What the tests share: servers, topologies, clocks, proxies, apps and processes."""
