//! Where a rank sends: one collector address, or a comma-separated list that splits
//! the ranks between collectors (`RANKSCOPE_COLLECTOR`, `--collector`).

use super::error::ConfigError;

/// The collectors of a run: one address, or several that split the ranks between
/// them. Rank `r` always sends to entry `r % len`, so each (run, rank) meets one
/// collector and deduplication, which each collector does for the ranks it sees,
/// stays exact. Every rank and every tool (`loadgen`, `replay`) must therefore be
/// given the same list, in the same order, for the whole run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectorList {
    addresses: Vec<String>,
}

impl CollectorList {
    /// Parses a comma-separated list; `var` names where it came from in errors
    /// (`RANKSCOPE_COLLECTOR`, `--collector`). Every entry is checked: not empty,
    /// `[http://|https://]HOST:PORT`, and TLS on all entries or on none.
    pub fn parse(var: &'static str, list: &str) -> Result<CollectorList, ConfigError> {
        let mut addresses = Vec::new();
        for (i, entry) in list.split(',').enumerate() {
            let address = entry.trim();
            if address.is_empty() {
                return Err(ConfigError::CollectorEmpty {
                    var,
                    list: list.into(),
                    entry: i + 1,
                });
            }
            if let Err(why) = check_address(address) {
                return Err(ConfigError::CollectorAddress {
                    var,
                    list: list.into(),
                    address: address.into(),
                    why,
                });
            }
            addresses.push(address.to_string());
        }
        let tls = addresses.iter().find(|a| a.starts_with("https://"));
        let plain = addresses.iter().find(|a| !a.starts_with("https://"));
        if let (Some(tls), Some(plain)) = (tls, plain) {
            return Err(ConfigError::CollectorMixed {
                var,
                list: list.into(),
                tls: tls.clone(),
                plain: plain.clone(),
            });
        }
        Ok(CollectorList { addresses })
    }

    /// The address rank `rank` sends to.
    pub fn for_rank(&self, rank: u32) -> &str {
        &self.addresses[rank as usize % self.addresses.len()]
    }

    pub fn len(&self) -> usize {
        self.addresses.len()
    }

    /// Never true: a list holds at least one address.
    pub fn is_empty(&self) -> bool {
        self.addresses.is_empty()
    }

    /// Whether the collectors are reached over TLS (`https://`).
    pub fn tls(&self) -> bool {
        self.addresses[0].starts_with("https://")
    }
}

/// `[http://|https://]HOST:PORT`, nothing else.
fn check_address(address: &str) -> Result<(), &'static str> {
    let rest = match address.split_once("://") {
        Some(("http" | "https", rest)) => rest,
        Some(_) => return Err("the scheme must be http or https"),
        None => address,
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let Some((host, port)) = rest.rsplit_once(':') else {
        return Err("no port");
    };
    if host.is_empty() || host == "[]" {
        return Err("no host");
    }
    if host
        .chars()
        .any(|c| c.is_whitespace() || matches!(c, '/' | '?' | '#' | '@'))
    {
        return Err("the host has a space, a path or a user");
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err("write an IPv6 host in brackets, [::1]:50051");
    }
    if let Some(ip) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']'))
        && ip.parse::<std::net::Ipv6Addr>().is_err()
    {
        return Err("the brackets hold no IPv6 address");
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => return Err("the port must be a number from 1 to 65535"),
    }
    // What the transport will connect to must be a URI it can parse.
    match tonic::transport::Endpoint::from_shared(format!("http://{rest}")) {
        Ok(_) => Ok(()),
        Err(_) => Err("the host has characters a host name cannot hold"),
    }
}
