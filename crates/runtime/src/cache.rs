//! Where dflash keeps what it downloads and compiles (models, CUDA kernels).

use std::ffi::OsString;
use std::path::PathBuf;

/// The cache directory: `$DFLASH_CACHE_DIR`, else `$XDG_CACHE_HOME/dflash`, else
/// `$HOME/.cache/dflash` (the system temp dir stands in for a missing home).
pub fn cache_dir() -> PathBuf {
    cache_dir_from(|name| std::env::var_os(name))
}

/// [`cache_dir`] over a given environment. Empty variables count as unset, and so does a relative
/// `XDG_CACHE_HOME`, as the XDG spec asks.
fn cache_dir_from(var: impl Fn(&str) -> Option<OsString>) -> PathBuf {
    let set = |name: &str| var(name).filter(|value| !value.is_empty()).map(PathBuf::from);
    if let Some(dir) = set("DFLASH_CACHE_DIR") {
        return dir;
    }
    if let Some(xdg) = set("XDG_CACHE_HOME").filter(|dir| dir.is_absolute()) {
        return xdg.join("dflash");
    }
    let home = set("HOME").unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("dflash")
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let map: HashMap<String, OsString> = pairs.iter().map(|(k, v)| (k.to_string(), OsString::from(v))).collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn cache_dir_precedence() {
        let all = [("DFLASH_CACHE_DIR", "/d"), ("XDG_CACHE_HOME", "/x"), ("HOME", "/h")];
        assert_eq!(cache_dir_from(vars(&all)), PathBuf::from("/d"));
        let no_dflash = [("DFLASH_CACHE_DIR", ""), ("XDG_CACHE_HOME", "/x"), ("HOME", "/h")];
        assert_eq!(cache_dir_from(vars(&no_dflash)), PathBuf::from("/x/dflash"));
        let relative_xdg = [("XDG_CACHE_HOME", "rel"), ("HOME", "/h")];
        assert_eq!(cache_dir_from(vars(&relative_xdg)), PathBuf::from("/h/.cache/dflash"));
        assert_eq!(cache_dir_from(vars(&[("HOME", "/h")])), PathBuf::from("/h/.cache/dflash"));
        assert_eq!(cache_dir_from(vars(&[])), std::env::temp_dir().join(".cache/dflash"));
    }
}
