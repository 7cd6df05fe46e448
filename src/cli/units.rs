//! Byte counts from people: parsing them with suffixes (printing them is the library's
//! `cachalot_tools::units`).

/// Parses a byte count: digits with an optional suffix `K`, `M`, `G`, `T` (powers of 1000)
/// or `KiB`, `MiB`, `GiB`, `TiB` (powers of 1024), `B` allowed, case-insensitive.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '_')
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let num: u64 = num
        .replace('_', "")
        .parse()
        .map_err(|_| format!("\"{s}\" is not a byte count (e.g. 80000000000, 80G, 141GiB)"))?;
    let mult: u64 = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "t" | "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        other => return Err(format!("unknown unit \"{other}\" in \"{s}\"")),
    };
    let bytes = num
        .checked_mul(mult)
        .ok_or_else(|| format!("\"{s}\" is too large"))?;
    if bytes == 0 {
        return Err("the device memory must be above 0 bytes".into());
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use cachalot_tools::units::{grouped, human};

    use super::*;

    #[test]
    fn sizes_print_in_binary_units() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(2 << 20), "2.000 MiB");
        assert_eq!(human(2_122_317_824), "1.977 GiB");
        assert_eq!(human(150_109_880_320), "139.8 GiB");
        assert_eq!(grouped(2_122_317_824), "2,122,317,824");
        assert_eq!(grouped(12), "12");
    }

    #[test]
    fn byte_counts_parse_with_suffixes() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("80G"), Ok(80_000_000_000));
        assert_eq!(parse_bytes("141GiB"), Ok(141 << 30));
        assert!(parse_bytes("12 parsecs").is_err());
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("99999999999999999999T").is_err());
    }
}
